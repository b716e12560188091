"""Failing together: one clear message, every rank out, never a hang.

Two situations:
  * set-up (config, dataset, batch arithmetic) runs inside :func:`agree`:
    every rank tries, the outcomes are all-gathered, and if any rank failed,
    all raise the same :class:`UserError` (marked ``agreed``). Rank 0 prints it
    once and every rank exits 2 - no MPI_Abort banner, no traceback.
  * anywhere else, an exception on one rank means the others are (or soon will
    be) stuck in a collective, so :func:`report_and_exit` prints it with the
    rank and calls ``MPI_Abort``, which ends every rank of the job.
"""

from __future__ import annotations

import sys
import traceback

from ..errors import EXIT_USER_ERROR, UserError


def agree(world, fn, *args, **kwargs):
    """Run ``fn`` on every rank; if it fails anywhere, raise the same error everywhere.

    Collective over ``world.comm``. The first failing rank's message wins; an
    unexpected exception is reported with its traceback line and rank.
    """
    failure = None
    result = None
    try:
        result = fn(*args, **kwargs)
    except UserError as exc:
        failure = (True, type(exc).__name__, str(exc))
    except Exception as exc:  # noqa: BLE001 - turned into a collective error below
        where = traceback.extract_tb(exc.__traceback__)[-1]
        failure = (False, type(exc).__name__,
                   f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})")
    failures = world.comm.allgather(failure)
    for rank, item in enumerate(failures):
        if item is not None:
            is_user, _, message = item
            if world.size > 1 and any(f is None or f[2] != message for f in failures):
                message = f"on rank {rank}: {message}"
            err = UserError(message) if is_user else RuntimeError(message)
            err.agreed = True
            raise err
    return result


def report_and_exit(exc: BaseException, world, before_exit=None) -> int:
    """Print ``exc`` once and end this rank (and, if needed, the whole job).

    ``before_exit(say)``, if given, runs after the report and before the exit or the abort (a
    checkpoint still being written in the background is finished there; ``say(line)`` prints a line
    the way the report was printed). Returns the exit code for a 1-rank world or an agreed error;
    otherwise it does not return (MPI_Abort).
    """
    agreed = getattr(exc, "agreed", False) or world is None or world.size == 1
    if isinstance(exc, UserError):
        code, text = getattr(exc, "exit_code", EXIT_USER_ERROR), f"hpctrain: error: {exc}"
    elif agreed:
        code, text = 1, f"hpctrain: internal error: {exc}"
    else:
        code = 1
        text = "".join(traceback.format_exception(exc)).rstrip()
    if agreed:
        if world is None or world.is_root:
            print(text, file=sys.stderr, flush=True)
        if before_exit is not None:
            try:
                before_exit(lambda line: print(line, file=sys.stderr, flush=True) if world is None or world.is_root
                            else None)
            except Exception:  # noqa: BLE001 - never in the way of the exit
                pass
        return code
    rank = world.rank
    print("\n".join(f"[rank {rank}] {line}" for line in text.splitlines()), file=sys.stderr, flush=True)
    if before_exit is not None:
        try:
            before_exit(lambda line: print(f"[rank {rank}] {line}", file=sys.stderr, flush=True))
        except Exception:  # noqa: BLE001 - the abort happens whatever the wait does
            pass
    print(f"[rank {rank}] hpctrain: aborting all {world.size} ranks", file=sys.stderr, flush=True)
    world.comm.Abort(code)
    return code  # not reached
