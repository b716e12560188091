"""``auto`` strategy: per message size, the strategy an alpha-beta model says is fastest.

At start-up (collective) every candidate is timed on the real world at :data:`PROBE_BYTES` (the
slowest rank's time, median of :data:`REPEATS` interleaved calls). Between neighbouring probe sizes
the model is the line t(n) = alpha + beta * n through the two measurements, extended beyond the
ends: piecewise, because MPI libraries switch algorithms with the message size and no single line
fits both ends. A call runs the candidate with the smallest predicted time for ``buf.nbytes``.
Rank 0 loads or fits and broadcasts, so every rank picks the same strategy for a size (a mismatch
would deadlock). Fits are cached in ``dist.auto_cache`` (JSON, one entry per layout key, updated
under a lock) and a checkpoint stores the ones its run used (:meth:`AutoAllreduce.choices`,
:meth:`~AutoAllreduce.restore_choices`). ``shm`` is a candidate where every rank shares one machine;
on a CPU device it is fitted twice, ``shm zero-copy`` on slices of its window (:meth:`allocate`)
and ``shm`` on plain arrays, so every rank must pass the same kind of buffer.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from .flat import FLAT
from .halves import WholeSumHalves
from .hierarchical import HierarchicalAllreduce
from .reduce_ops import sum_scaled
from .staging import Staging

PROBE_BYTES = (4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20)  # up to a 25 MB bucket
CANDIDATES = ("mpi", "ring", "rhd", "hierarchical", "shm")
ZERO_COPY = "shm zero-copy"  # the fit of shm on allocate()d buffers
REPEATS = 7  # median of 7 turns: this 2-core machine has 2-4x outliers; 3 in a row picked ring over shm at 32 MB


class AutoAllreduce(WholeSumHalves):
    """ZeRO's halves: the picked strategy's reduce-scatter (:meth:`reduce_scatter`), then
    MPI_Allgatherv (:class:`~.halves.WholeSumHalves`)."""

    def __init__(self, world, device, staging=None, cache_path: str = "", log=None, candidates=CANDIDATES):
        self.world, self.device, self.comm, self.size = world, device, world.comm, world.size
        self.staging = staging or Staging(device)
        from ..errors import LaunchError

        self._picked: dict = {}
        self.strategies = {}
        strategies = {**FLAT, "hierarchical": HierarchicalAllreduce}
        for name in (n for n in candidates if n in strategies):
            try:
                self.strategies[name] = strategies[name](world, device, staging)
            except LaunchError:  # shm across machines: the same verdict on every rank
                continue
        self.names = list(self.strategies)
        self._shm = self.strategies.get("shm") if device.name == "cpu" else None
        if self._shm is not None:
            # the trainer keeps its gradients where shm reduces them without copies
            self.allocate = self._shm.allocate
            self.names.append(ZERO_COPY)
        self.key = self._key()
        fits = _load(cache_path, self.key) if world.rank == 0 else None
        source = "cache " + cache_path if fits else "measured"
        if not world.comm.bcast(fits is not None, root=0):
            fits = self._measure()
        self.fits = world.comm.bcast(fits, root=0)      # {name: [(alpha_s, beta_s_per_byte) per segment]}
        if world.rank == 0:
            if source == "measured" and cache_path:
                _save(cache_path, self.key, self.fits)
            if log is not None:
                log.info(f"allreduce auto ({source}): " + self.describe())

    def choices(self) -> dict:
        """What a checkpoint stores: the key and the fits this run picks by (JSON-able)."""
        return {"key": self.key, "fits": {n: [list(seg) for seg in f] for n, f in self.fits.items()}}

    def restore_choices(self, saved: dict, log=None) -> bool:
        """Take the fits a checkpoint's run used (``saved``: its :meth:`choices`) when it ran at this
        layout (the same key), so the resumed run picks as it did; returns whether they were taken.
        Every rank reads the same checkpoint, so all decide alike (no communication)."""
        if not saved or saved.get("key") != self.key:
            if log is not None and saved:
                log.info("allreduce auto: the checkpoint's choices were made at another layout; "
                         "this run keeps its own (" + self.describe() + ")")
            return False
        self.adopt_fits({n: [tuple(seg) for seg in f] for n, f in saved["fits"].items()})
        if log is not None:
            log.info("allreduce auto (the checkpoint's choices): " + self.describe())
        return True

    def adopt_fits(self, fits: dict) -> None:
        """Use ``fits`` (another group's measurements, same candidates) from now on: groups that
        must reduce alike (tensor parallelism's data groups, comm.grid) pick alike."""
        self.fits = fits
        self._picked.clear()

    def choose(self, nbytes: int, zero_copy: bool = False) -> str:
        """The name of the fit predicted fastest for a message of ``nbytes``; ``zero_copy``: the
        buffer is a slice of a window from :meth:`allocate` (only then is ``shm zero-copy`` a choice,
        and plain ``shm`` is not)."""
        seg = min(max(int(np.searchsorted(PROBE_BYTES, nbytes)) - 1, 0), len(PROBE_BYTES) - 2)
        skip = "shm" if zero_copy else ZERO_COPY
        names = [n for n in self.names if n != skip]
        return min(names, key=lambda n: self.fits[n][seg][0] + self.fits[n][seg][1] * nbytes)

    def __call__(self, buf, op="mean"):
        return self._pick(buf)(buf, op)

    def reduce_scatter(self, buf):
        """ZeRO's reduce-scatter (:mod:`.halves`) by the strategy picked for ``buf``: its own where it
        leaves this rank chunk ``rank`` as ZeRO's shares expect (mpi, naive, rhd, shm), else its
        whole sum (ring, whose chunks are shifted by one). Collective."""
        picked = self._pick(buf)
        if picked.owned_chunk(self.world.rank, self.size) == self.world.rank:
            return picked.reduce_scatter(buf)
        return picked(buf, "sum")

    def sum_scaled(self, buf, factor: float, check_finite: bool = False) -> bool:
        """``buf`` summed over ranks, scaled by ``factor`` and tested, by the picked strategy
        (:func:`~hpctrain.comm.reduce_ops.sum_scaled`: in one pass where it can, shm zero-copy,
        testing only this rank's share there). Collective."""
        return sum_scaled(self._pick(buf), buf, factor, self.device, check_finite)

    def _pick(self, buf):
        # memoised per (size, kind of buffer): the model costs ~7 us, a 4 KB all-reduce ~35 us
        key = (buf.nbytes, self._shm is not None and self._shm.holds(buf))
        strategy = self._picked.get(key)
        if strategy is None:
            strategy = self._picked[key] = self.strategies[self.choose(*key).replace(" zero-copy", "")]
        return strategy

    def describe(self) -> str:
        # latency from the smallest segment, bandwidth from the largest
        parts = [f"{n} alpha {1e6 * f[0][0]:.1f} us, {1e-9 / f[-1][1]:.2f} GB/s" for n, f in self.fits.items()]
        sizes = (4 << 10, 256 << 10, 4 << 20, 64 << 20)
        picks = ", ".join(f"{_human(s)}->{self.choose(s)}" for s in sizes)
        if ZERO_COPY in self.names:
            picks += "; in the shared window " + ", ".join(f"{_human(s)}->{self.choose(s, True)}" for s in sizes)
        return "; ".join(parts) + f" | picks {picks}"

    # ---- measuring -----------------------------------------------------------------
    def _measure(self) -> dict | None:
        """Collective: time every candidate at every probe size; rank 0 returns the fits."""
        from mpi4py import MPI

        comm = self.world.comm
        itemsize = self.device.dtype.itemsize
        times = {n: [] for n in self.names}
        # shm zero-copy is timed on slices of a window made for the probes and freed after
        window = self._shm.allocate(PROBE_BYTES[-1] // itemsize, self.device.dtype) if self._shm else None
        for nbytes in PROBE_BYTES:
            buf = self.device.zeros(nbytes // itemsize)
            calls = {name: (self.strategies[name.replace(" zero-copy", "")],
                            window[:buf.size] if name == ZERO_COPY else buf) for name in self.names}
            for strategy, probe in calls.values():
                strategy(probe, "sum")            # warm-up (JIT, scratch buffers)
            samples = {name: [] for name in self.names}
            # candidates take turns call by call, so a burst of load elsewhere on the
            # machine hits them alike instead of deciding the choice on its own
            for _ in range(REPEATS):
                for name, (strategy, probe) in calls.items():
                    comm.Barrier()
                    t0 = time.perf_counter()
                    strategy(probe, "sum")
                    samples[name].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            for name in self.names:
                times[name].append(float(np.median(samples[name])))
        if window is not None:
            self._shm.release(window)
        if self.world.rank != 0:
            return None
        return {n: _segments(PROBE_BYTES, t) for n, t in times.items()}

    def _key(self) -> dict:
        from mpi4py import MPI

        w = self.world
        return {"size": w.size, "n_nodes": w.n_nodes,
                "local_sizes": sorted(w.comm.allgather(w.local_size)), "dtype": self.device.dtype.name,
                "device": self.device.name, "mpi": MPI.Get_library_version().splitlines()[0].strip(),
                "candidates": self.names, "probe_bytes": list(PROBE_BYTES)}


def _segments(sizes, times) -> list[tuple[float, float]]:
    """(alpha, beta) of the line through each pair of neighbouring measurements.

    beta is kept >= 1e-15 s/byte and alpha >= 0: noise can make a segment
    fall, which would predict ever faster transfers beyond the last probe.
    """
    out = []
    for (n0, t0), (n1, t1) in zip(zip(sizes, times), zip(sizes[1:], times[1:])):
        beta = max((t1 - t0) / (n1 - n0), 1e-15)
        out.append((max(t1 - beta * n1, 0.0), beta))
    return out


MAX_ENTRIES = 64  # keys kept in one cache file; the oldest entry goes first


def _entries(path: str) -> list:
    """The cache file's entries ([{"key", "fits"}]); [] when there is none or it cannot be read
    (measure again; the next save rewrites it). A file of one entry (older versions) is one."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return []
    if not isinstance(doc, dict):
        return []
    entries = doc.get("entries", [doc] if "key" in doc else [])
    return [e for e in entries if isinstance(e, dict) and "key" in e and isinstance(e.get("fits"), dict)]


def _load(path: str, key: dict):
    if not path:
        return None
    for entry in _entries(path):
        if entry["key"] == key:
            return {n: [tuple(seg) for seg in v] for n, v in entry["fits"].items()}
    return None


def _save(path: str, key: dict, fits: dict) -> None:
    """Add (or replace) ``key``'s entry: under an exclusive lock of ``path.lock`` (jobs sharing the
    file update it in turn, none losing another's entry), written whole and renamed into place
    (readers never see half a file)."""
    import fcntl

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = [e for e in _entries(path) if e["key"] != key] + [{"key": key, "fits": fits}]
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump({"entries": entries[-MAX_ENTRIES:]}, fh, indent=1)
        os.replace(tmp, path)


def _human(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:g} {unit}"
        nbytes /= 1024
