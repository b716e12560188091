"""``auto`` strategy: per message size, the strategy an alpha-beta model says is fastest.

At start-up every candidate strategy is timed on the real world at a few
message sizes (collectively, the slowest rank's time counts). Between each
pair of neighbouring probe sizes the model is the line t(n) = alpha + beta * n
(alpha: latency, beta: seconds per byte) through the two measurements; below
the first and above the last probe the nearest segment extends. One line over
all sizes was tried first and chose badly: MPI libraries switch algorithms
with the message size, so no single alpha and beta fit both ends. A call runs
the strategy with the smallest predicted time for ``buf.nbytes``. Rank 0 fits and broadcasts, so every rank
picks the same strategy for the same size (they must: a mismatch would
deadlock). The fit is cached in a JSON file keyed by everything it depends on
(world shape, dtype, device, MPI library, candidates) and logged once.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

PROBE_BYTES = (4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20)  # up to a 25 MB bucket
CANDIDATES = ("mpi", "ring", "rhd", "hierarchical")
REPEATS = 3


class AutoAllreduce:
    def __init__(self, world, device, staging=None, cache_path: str = "", log=None, candidates=CANDIDATES):
        from . import STRATEGIES

        self.world, self.device = world, device
        self.names = [n for n in candidates if n in STRATEGIES]
        self._picked: dict = {}
        self.strategies = {n: STRATEGIES[n](world, device, staging) for n in self.names}
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

    def choose(self, nbytes: int) -> str:
        """The name of the strategy predicted fastest for a message of ``nbytes``."""
        seg = min(max(int(np.searchsorted(PROBE_BYTES, nbytes)) - 1, 0), len(PROBE_BYTES) - 2)
        return min(self.names, key=lambda n: self.fits[n][seg][0] + self.fits[n][seg][1] * nbytes)

    def __call__(self, buf, op="mean"):
        # memoised per size: the model costs ~7 us, a 4 KB all-reduce ~35 us
        strategy = self._picked.get(buf.nbytes)
        if strategy is None:
            strategy = self._picked[buf.nbytes] = self.strategies[self.choose(buf.nbytes)]
        return strategy(buf, op)

    def describe(self) -> str:
        # latency from the smallest segment, bandwidth from the largest
        parts = [f"{n} alpha {1e6 * f[0][0]:.1f} us, {1e-9 / f[-1][1]:.2f} GB/s" for n, f in self.fits.items()]
        picks = ", ".join(f"{_human(s)}->{self.choose(s)}" for s in (4 << 10, 256 << 10, 4 << 20, 64 << 20))
        return "; ".join(parts) + f" | picks {picks}"

    # ---- measuring -----------------------------------------------------------------
    def _measure(self) -> dict | None:
        """Collective: time every candidate at every probe size; rank 0 returns the fits."""
        from mpi4py import MPI

        comm = self.world.comm
        itemsize = self.device.dtype.itemsize
        times = {n: [] for n in self.names}
        for nbytes in PROBE_BYTES:
            buf = self.device.zeros(nbytes // itemsize)
            for name in self.names:
                self.strategies[name](buf, "sum")            # warm-up (JIT, scratch buffers)
                samples = []
                for _ in range(REPEATS):
                    comm.Barrier()
                    t0 = time.perf_counter()
                    self.strategies[name](buf, "sum")
                    samples.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
                times[name].append(float(np.median(samples)))
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


def _load(path: str, key: dict):
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None  # unreadable or corrupt: measure again and overwrite
    if doc.get("key") != key:
        return None
    return {n: [tuple(seg) for seg in v] for n, v in doc["fits"].items()}


def _save(path: str, key: dict, fits: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump({"key": key, "fits": fits}, fh, indent=1)
    os.replace(tmp, path)  # readers never see half a file


def _human(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:g} {unit}"
        nbytes /= 1024
