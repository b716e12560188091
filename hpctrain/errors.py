"""User-facing errors: each names the problem and the fix.

Anything raised as a :class:`UserError` is printed once (by rank 0) as
``hpctrain: error: <message>`` and every rank exits with :data:`EXIT_USER_ERROR`.
Any other exception is a bug or a fault and aborts the whole MPI job.
"""

EXIT_USER_ERROR = 2
EXIT_TARGET_MISSED = 3
EXIT_CHECKPOINTED = 75  # stopped by SIGUSR1/SIGTERM after saving a checkpoint (EX_TEMPFAIL: run again)


class UserError(Exception):
    """A problem the user can fix (bad config, bad data, bad launch)."""


class ConfigError(UserError):
    """An unknown key, a wrong type or an out-of-range value in the config."""


class DataError(UserError):
    """A missing, malformed or too-small dataset."""


class LaunchError(UserError):
    """A launch that cannot work, e.g. a world size that does not divide the batch."""
