"""When to save, where, what to resume from, and how many checkpoints to keep.

``CheckpointManager`` is built by the trainer on every rank from the run's plan (all of its
methods that touch files or MPI are collective); what it saves and loads is a
:class:`~hpctrain.training.state.TrainingState`:

  * ``resume(state)``: ``checkpoint.resume`` = "" (fresh start), "auto" (the newest checkpoint in
    ``checkpoint.dir`` that verifies, corrupt ones skipped with a warning; none at all is a fresh
    start, but if there are some and none verifies the run stops rather than lose them) or a path;
  * ``step_due(step)``: every ``every_steps`` steps; ``time_due()``: ``every_minutes``,
    judged by rank 0's clock and agreed in the run loop's per-step all-reduce;
  * ``save(state, wait)``: an atomic parallel write (:mod:`.write`), then rank 0
    deletes checkpoints older than it beyond ``keep_last`` (never newer ones); with
    ``checkpoint.async_save`` and ``wait`` False the rank's share is copied aside and a thread
    writes it while training goes on (``wait()`` joins it; the next save, a rollback and ``close``
    wait for it);
  * ``rollback(state)``: the newest checkpoint this run saved or loaded, again (``guard.nonfinite``).
"""

from __future__ import annotations

import glob
import json
import os
import time
import tomllib

from ..errors import UserError
from ..reliability.fail_together import agree
from .background import BackgroundSave, duplicate, threads_may_call_mpi
from .compress_state import SavedCompress
from .format import list_checkpoints
from .read import CorruptCheckpoint, load_checkpoint
from .state import needed_boxes, restore, snapshot, training_state, wanted
from .write import CheckpointWriteError, write_checkpoint


class CheckpointManager:
    """Saves, resumes and rolls back the training state of the run ``plan`` lays out. ``hooks``:
    the tests' fault hooks for saves (:class:`~hpctrain.reliability.faults.Faults`), or None."""

    def __init__(self, plan, log, hooks=None):
        self.plan, self.cfg, self.world, self.log, self.hooks = plan, plan.cfg, plan.world, log, hooks
        self.c = self.cfg.checkpoint
        self.directory = self.c.dir
        self.clock = time.monotonic  # rank 0's clock for every_minutes (tests substitute one)
        self._last_save = self.clock()
        self.saved_step = None      # step of the newest checkpoint this run wrote or loaded
        self.saved_path = None      # and its file (what guard.nonfinite = rollback reloads)
        self.save_seconds = 0.0     # time the last save stopped training (its copy, when in the background)
        self._pending = None        # the save in flight in the background (a BackgroundSave)
        self._copies = {}           # its host copies, kept for the next background save (state.snapshot)
        # checkpoint.async_save: the background writer's own communicators (collective to make), so its
        # collectives never pair with the training thread's; it needs MPI_THREAD_MULTIPLE
        self._background = duplicate(self.world) if self.c.async_save and threads_may_call_mpi(log) else None

    # ---- policy -------------------------------------------------------------------
    def step_due(self, step: int) -> bool:
        return bool(self.c.every_steps) and step % self.c.every_steps == 0

    def time_due(self) -> bool:
        """Rank 0's view of ``every_minutes`` (the run loop all-reduces it)."""
        return bool(self.c.every_minutes) and self.clock() - self._last_save >= 60.0 * self.c.every_minutes

    # ---- save ---------------------------------------------------------------------
    def save(self, state, wait: bool = True, watch=None) -> str | None:
        """Save ``state`` as checkpoint ``state.step``; returns its path. With ``wait`` False and
        ``checkpoint.async_save``, only this rank's share is copied aside here and a background
        thread writes, checks and commits it (:meth:`wait` joins it; None is returned) inside
        ``watch()`` (a context manager: the stall watchdog's, or None). Either way a save still in
        flight is waited for first: at most one at a time. Collective."""
        self.wait()
        t0 = time.perf_counter()
        epoch = state.sampler.position(state.step)[0]
        attrs = {"epoch": epoch, "config": self.cfg.to_toml(), "optimizer": self.cfg.optim.name,
                 "dtype": self.cfg.train.dtype, "compress": self.cfg.dist.compress,
                 "compress_scope": self.cfg.dist.compress_scope, "tensor_parallel": self.cfg.dist.tensor_parallel,
                 # what /compress's rows are laid out by (the compressor's buckets; "" without compression)
                 "bucket_layout": getattr(getattr(state, "compression", None), "layout", "")}
        choices = getattr(self.plan.allreduce, "choices", None)  # dist.allreduce = auto: what it picks by
        if choices is not None:
            attrs["allreduce_auto"] = json.dumps(choices())
        entries = training_state(state, self.plan)
        self._last_save = self.clock()
        if wait or self._background is None:
            path = self._write(state.step, entries, attrs, self.world)
            self.save_seconds = time.perf_counter() - t0
            self._committed(state.step, path, f"{self.save_seconds:.2f} s")
            return path
        # the step waits only for this copy (into the host arrays of the last one: the write that read them is done)
        copies = agree(self.world, snapshot, entries, self.world.rank, self._copies)
        self.save_seconds = time.perf_counter() - t0
        step = state.step   # read now: the training thread moves state.step on while the writer runs
        self._pending = BackgroundSave(step, t0, self.save_seconds)
        self._pending.start(lambda: self._write(step, copies, attrs, self._background), watch)
        self.log.info(f"checkpoint: step {state.step} copied aside in {self.save_seconds:.2f} s, writing it in the "
                      f"background")
        return None

    def _write(self, step, entries, attrs, world) -> str:
        """The collective write and commit over ``world`` (the job's communicators, or the background
        writer's duplicates), then rank 0 prunes; nobody returns while rank 0 may still delete."""
        path = write_checkpoint(self.directory, step, entries, attrs, world, log=self.log,
                                collective=self.c.collective_io, writers_per_node=self.c.writers_per_node,
                                hooks=self.hooks)
        if world.is_root:
            self._prune(step)
        world.comm.Barrier()
        return path

    def _committed(self, step: int, path: str, took: str) -> None:
        self.saved_step, self.saved_path = step, path
        self.log.info(f"checkpoint: saved {path} (step {step}, {took})")

    @property
    def in_flight(self) -> int | None:
        """The step of the save in flight in the background, or None."""
        return None if self._pending is None else self._pending.step

    def wait(self) -> None:
        """Wait for the save in flight in the background, if any: its commit, or its error (a
        :class:`~.write.CheckpointWriteError` agreed by every rank, raised here on every rank).
        Collective in effect (every rank's writer takes part in the same write)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        path = pending.join()
        self._committed(pending.step, path, f"{pending.stalled:.2f} s of training stalled, "
                                            f"{pending.seconds:.2f} s in the background")

    def close(self) -> None:
        """Free the background writer's communicators, unless a save is still in flight (a run that
        ended by an error: its thread may still be in them, and the process ends anyway)."""
        if self._background is not None and self._pending is None:
            for comm in {id(c): c for c in (self._background.comm, self._background.local_comm)
                         if c is not None}.values():
                comm.Free()
            self._background = None

    def _prune(self, saved: int):
        """Keep the checkpoint just saved and the keep_last - 1 newest before it. Files with a
        higher step (another run's, or ones this run resumed behind) are never touched."""
        keep = self.c.keep_last
        if keep <= 0:
            return
        try:
            older = [path for step, path in list_checkpoints(self.directory) if step < saved]
        except OSError as exc:   # rank 0 alone: never an error the others would wait for
            self.log.warn(f"could not list {self.directory} to delete old checkpoints: {exc.strerror or exc}")
            return
        for path in older[keep - 1:]:
            try:
                os.remove(path)
            except OSError as exc:
                self.log.warn(f"could not delete old checkpoint {path}: {exc.strerror or exc}")

    # ---- resume -------------------------------------------------------------------
    def resume(self, state) -> None:
        spec, world, log = self.c.resume, self.world, self.log
        if world.is_root:
            self._remove_stale_temporaries()
        if not spec:
            found = list_checkpoints(self.directory) if world.is_root else []
            if found:
                log.info(f"checkpoint: {self.directory} holds checkpoints up to step {found[0][0]}; starting "
                         f"fresh (pass --resume auto to continue from them)")
            return
        if spec == "auto":
            candidates = world.comm.bcast([p for _, p in list_checkpoints(self.directory)]
                                          if world.is_root else None, root=0)
            if not candidates:
                log.info(f"checkpoint: none in {self.directory}; fresh start")
                return
        else:
            agree(world, _check_exists, spec)
            candidates = [spec]
        skipped = []
        layout = needed_boxes(state, self.plan)   # (collective over the pipeline group)
        for path in candidates:
            try:
                loaded = load_checkpoint(path, world, wanted(layout))
            except CorruptCheckpoint as exc:  # UnreadableCheckpoint (permissions, a missing mount) stops the run
                if spec != "auto":
                    raise
                log.warn(f"skipping {path}: {exc}")
                skipped.append(path)
                continue
            agree(world, restore, state, self.plan, loaded, layout, log, _saved_compress(loaded.attrs))
            self.saved_step, self.saved_path = state.step, path
            log.info(f"checkpoint: resumed from {path} at step {state.step} (saved by "
                     f"{loaded.world_size} rank(s), hpctrain {loaded.attrs.get('hpctrain_version')})")
            self._restore_choices(loaded.attrs)
            return
        err = UserError(f"checkpoint.dir {self.directory!r} holds {len(skipped)} checkpoint(s) and none verifies "
                        f"(see the warnings above; 'python -m hpctrain ckpt ls {self.directory} --verify' lists "
                        f"them); starting fresh would lose that run: move them away or pass --resume '' to "
                        f"start fresh on purpose")
        err.agreed = True  # every rank reached the same verdicts
        raise err

    def rollback(self, state) -> None:
        """Reload the newest checkpoint this run saved or loaded (guard.nonfinite = rollback); a
        background save that failed meanwhile leaves the one before it. Collective."""
        try:
            self.wait()
        except CheckpointWriteError as exc:   # agreed: every rank rolls back to the same file
            self.log.warn(f"{exc}; rolling back to {self.saved_path}")
        layout = needed_boxes(state, self.plan)
        loaded = load_checkpoint(self.saved_path, self.world, wanted(layout))
        agree(self.world, restore, state, self.plan, loaded, layout, self.log, _saved_compress(loaded.attrs))
        self.log.info(f"guard: rolled back to {self.saved_path} (step {state.step})")

    def _restore_choices(self, attrs) -> None:
        """The all-reduce choices the saved run made (``dist.allreduce = auto``), taken back when this
        run has the same layout, so a resume reduces as the saved run did (every rank alike: they
        read the same attributes)."""
        restore = getattr(self.plan.allreduce, "restore_choices", None)
        text = attrs.get("allreduce_auto")
        if restore is not None and text:
            try:
                saved = json.loads(str(text))
            except ValueError:
                saved = None
            restore(saved if isinstance(saved, dict) else None, self.log)

    def _remove_stale_temporaries(self):
        """Temporary files of saves that crashed: never checkpoints, safe to delete before we write."""
        for path in glob.glob(os.path.join(glob.escape(self.directory), ".ckpt-*.h5.tmp")):
            try:
                os.remove(path)
                self.log.info(f"checkpoint: removed {path}, left by an interrupted save")
            except OSError:
                pass


def _check_exists(path):
    if not os.path.isfile(path):
        raise UserError(f"--resume {path!r}: no such checkpoint file; use --resume auto to take the newest "
                        f"valid one in checkpoint.dir, or list them with 'python -m hpctrain ckpt ls DIR'")


def check_writable(directory: str) -> None:
    """Make ``directory`` (every rank) and check it accepts files, before any training."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise UserError(f"checkpoint.dir={directory!r} cannot be created ({exc.strerror or exc}); "
                        f"choose a writable directory (--set checkpoint.dir=PATH)") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UserError(f"checkpoint.dir={directory!r} is not writable; choose a writable directory "
                        f"(--set checkpoint.dir=PATH)")


def _saved_compress(attrs) -> SavedCompress:
    """What the compressor state (per-rank residuals) of a checkpoint was made under: the
    compressor, its scope, the tensor-parallel size and the bucket layout from the file's attributes, momentum
    correction and train.grad_accum_steps from the stored config (defaults where absent)."""
    try:
        stored = tomllib.loads(str(attrs.get("config", "")))
    except tomllib.TOMLDecodeError:
        stored = {}
    dist, train = stored.get("dist", {}), stored.get("train", {})
    momentum = bool(dist.get("compress_momentum", False)) if isinstance(dist, dict) else False
    k = train.get("grad_accum_steps", 1) if isinstance(train, dict) else 1
    return SavedCompress(attrs.get("compress", "none"), attrs.get("compress_scope", "all"),
                         int(attrs.get("tensor_parallel", 1)), momentum, k if isinstance(k, int) and k >= 1 else 1,
                         str(attrs.get("bucket_layout", "")))
