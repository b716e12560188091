"""User-facing errors: each names the problem and the fix.

Anything raised as a :class:`UserError` is printed once (by rank 0) as
``hpctrain: error: <message>`` and every rank exits with its ``exit_code``
(:data:`EXIT_USER_ERROR` unless the class sets another).
Any other exception is a bug or a fault and aborts the whole MPI job.
"""

EXIT_USER_ERROR = 2
EXIT_TARGET_MISSED = 3
EXIT_STALLED = 4       # the watchdog ended a collective that waited longer than dist.comm_timeout
EXIT_DIVERGED = 5      # non-finite loss/gradients or a loss spike under guard.nonfinite = abort, or too many bad steps
EXIT_GAVE_UP = 6       # python -m hpctrain launch: too many failures, or two in a row before a step
EXIT_CHECKPOINTED = 75  # stopped by SIGUSR1/SIGTERM after saving a checkpoint (EX_TEMPFAIL: run again)


class UserError(Exception):
    """A problem the user can fix (bad config, bad data, bad launch)."""

    exit_code = EXIT_USER_ERROR


class ConfigError(UserError):
    """An unknown key, a wrong type or an out-of-range value in the config."""


class DataError(UserError):
    """A missing, malformed or too-small dataset."""


class TrainingDiverged(UserError):
    """Non-finite loss or gradients (or loss spikes) the numerical guard may not skip."""

    exit_code = EXIT_DIVERGED


class LaunchError(UserError):
    """A launch that cannot work, e.g. a world size that does not divide the batch."""
