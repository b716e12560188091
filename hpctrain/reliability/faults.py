"""Fault injection for the reliability tests: the one seam through which test hooks enter a run.

Every hook is read here, once, when a trainer is built; no production path reads them.

  HPCTRAIN_FAULT=KIND:STEP[:RANK][,...]  on rank RANK (default 0), just before global step STEP:
      nan (a NaN feature in its batch), spike (its batch x1000; both float inputs only), raise,
      segv (reads address 0), hang (sleeps in Python); STEP ``start`` (raise, segv, hang: before
      start-up's first collective) or ``exit`` (hang, segv: after the run, before MPI_Finalize)
  HPCTRAIN_STEP_DELAY_S=S        every rank sleeps S s before each step, outside its timed phases
  HPCTRAIN_CKPT_WRITE_DELAY_S=S  a save sleeps between its data writes and its commit
  HPCTRAIN_CKPT_STOP_RANK=R      rank R SIGSTOPs itself just before a save's collective close
  HPCTRAIN_CKPT_DELAY_STEP=N     the two save hooks act only in the save of step N

:func:`hpctrain.ckpt.write.write_checkpoint` calls the save hooks. Killing or stopping a rank
otherwise comes from outside (kill -9, SIGSTOP), as a real failure would (docs/reliability.md).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from ..errors import ConfigError

KINDS = ("nan", "spike", "raise", "segv", "hang")
START_UP = -1  # the step number of "start"
AT_EXIT = -2   # the step number of "exit"


def parse(text: str) -> list[tuple[str, int, int]]:
    """``"nan:5:1,raise:9,hang:start:2"`` -> [("nan", 5, 1), ("raise", 9, 0), ("hang", -1, 2)] as
    (kind, step, rank); step ``start`` is :data:`START_UP`, ``exit`` :data:`AT_EXIT`."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = item.split(":")
        start = len(fields) > 1 and fields[1] == "start" and fields[0] in ("raise", "segv", "hang")
        at_exit = len(fields) > 1 and fields[1] == "exit" and fields[0] in ("hang", "segv")
        named = start or at_exit
        if (len(fields) not in (2, 3) or fields[0] not in KINDS
                or not all(f.isdigit() for f in fields[2 if named else 1:])):
            raise ConfigError(f"HPCTRAIN_FAULT={text!r}: expected KIND:STEP[:RANK] items with KIND one of "
                              f"{', '.join(KINDS)} and STEP a number (or start, for raise, segv, hang; "
                              f"exit, for hang and segv), e.g. nan:5:1")
        step = START_UP if start else AT_EXIT if at_exit else int(fields[1])
        faults.append((fields[0], step, int(fields[2]) if len(fields) == 3 else 0))
    return faults


class Faults:
    """The faults meant for ``rank``: by step, and in checkpoint saves. ``text``: the
    HPCTRAIN_FAULT list (default: the environment's); ``env``: where every hook is read
    (default ``os.environ``)."""

    def __init__(self, rank: int, text: str | None = None, env=None):
        env = os.environ if env is None else env
        text = env.get("HPCTRAIN_FAULT", "") if text is None else text
        self.rank = rank
        self.by_step = {step: kind for kind, step, r in parse(text) if r == rank}
        self.step_delay_s = _number(env, "HPCTRAIN_STEP_DELAY_S", float) or 0.0
        self.save_delay_s = _number(env, "HPCTRAIN_CKPT_WRITE_DELAY_S", float) or 0.0
        self.save_step = _number(env, "HPCTRAIN_CKPT_DELAY_STEP", int)
        self.save_stop_rank = _number(env, "HPCTRAIN_CKPT_STOP_RANK", int)

    def check_inputs(self, input_dtype) -> None:
        """Refuse, at start-up (where every rank agrees on errors), nan/spike faults on inputs that
        are not floats: token ids cannot hold a NaN, and scaled ids would index past the embedding."""
        for step, kind in self.by_step.items():
            if kind in ("nan", "spike") and input_dtype is not None and np.dtype(input_dtype).kind != "f":
                raise ConfigError(f"HPCTRAIN_FAULT {kind}:{step}: poisons float inputs (model.kind = \"mlp\"); "
                                  f"this model's inputs are token ids")

    def pace(self) -> None:
        """Before a step, outside its timed phases: HPCTRAIN_STEP_DELAY_S."""
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)

    def at_start_up(self) -> None:
        """Apply the ``start`` fault, if any (raise, segv or hang)."""
        self.before_step(START_UP, None)

    def at_exit(self) -> None:
        """Apply the ``exit`` fault, if any: hang, or segv a second later (by then every rank has
        said its run is over, as when a rank crashes in MPI_Finalize)."""
        if self.by_step.get(AT_EXIT) == "segv":
            time.sleep(1.0)
        self.before_step(AT_EXIT, None)

    def before_step(self, step: int, x: np.ndarray) -> np.ndarray:
        """Apply this step's fault, if any; returns the (possibly poisoned copy of the) batch."""
        kind = self.by_step.get(step)
        if kind is None:
            return x
        if kind == "nan":
            x = np.array(x, copy=True)  # the reader's batch may be a view of its cached window
            x.flat[0] = np.nan
        elif kind == "spike":
            x = np.asarray(x) * np.asarray(1000, x.dtype)
        elif kind == "raise":
            where = "start-up" if step == START_UP else f"step {step}"
            raise RuntimeError(f"injected fault at {where} (HPCTRAIN_FAULT)")
        elif kind == "segv":
            import ctypes

            ctypes.string_at(0)
        elif kind == "hang":
            while True:
                time.sleep(1.0)
        return x

    # ---- checkpoint saves (hpctrain.ckpt.write) ----
    def _in_save(self, step: int) -> bool:
        return self.save_step is None or self.save_step == step

    def before_commit(self, step: int) -> None:
        """Between a save's data writes and its commit: HPCTRAIN_CKPT_WRITE_DELAY_S."""
        if self.save_delay_s > 0 and self._in_save(step):
            time.sleep(self.save_delay_s)

    def before_close(self, step: int) -> None:
        """Just before the file's collective close: the rank HPCTRAIN_CKPT_STOP_RANK names stops itself."""
        if self.save_stop_rank == self.rank and self._in_save(step):
            os.kill(os.getpid(), signal.SIGSTOP)


def _number(env, name: str, kind):
    """``env[name]`` as ``kind``; None when unset or empty."""
    text = env.get(name, "")
    if not text:
        return None
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r}: expected a number") from None
