"""``auto`` strategy: per message size, the strategy an alpha-beta model says is fastest.

At start-up every candidate strategy is timed on the real world at a few
message sizes (collectively, the slowest rank's time counts), and a line
t(n) = alpha + beta * n (alpha: latency, beta: seconds per byte) is fitted by
least squares per strategy. A call then runs the strategy with the smallest
predicted time for ``buf.nbytes``. Rank 0 fits and broadcasts, so every rank
picks the same strategy for the same size (they must: a mismatch would
deadlock). The fit is cached in a JSON file keyed by everything it depends on
(world shape, dtype, device, MPI library, candidates) and logged once.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

PROBE_BYTES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)
CANDIDATES = ("mpi", "ring", "rhd", "hierarchical")
REPEATS = 3


class AutoAllreduce:
    def __init__(self, world, device, staging=None, cache_path: str = "", log=None, candidates=CANDIDATES):
        from . import STRATEGIES

        self.world, self.device = world, device
        self.names = [n for n in candidates if n in STRATEGIES]
        self.strategies = {n: STRATEGIES[n](world, device, staging) for n in self.names}
        self.key = self._key()
        fits = _load(cache_path, self.key) if world.rank == 0 else None
        source = "cache " + cache_path if fits else "measured"
        if not world.comm.bcast(fits is not None, root=0):
            fits = self._measure()
        self.fits = world.comm.bcast(fits, root=0)      # {name: (alpha_s, beta_s_per_byte)}
        if world.rank == 0:
            if source == "measured" and cache_path:
                _save(cache_path, self.key, self.fits)
            if log is not None:
                log.info(f"allreduce auto ({source}): " + self.describe())

    def choose(self, nbytes: int) -> str:
        """The name of the strategy predicted fastest for a message of ``nbytes``."""
        return min(self.names, key=lambda n: self.fits[n][0] + self.fits[n][1] * nbytes)

    def __call__(self, buf, op="mean"):
        return self.strategies[self.choose(buf.nbytes)](buf, op)

    def describe(self) -> str:
        parts = [f"{n} alpha {1e6 * a:.1f} us, {1e-9 / b if b > 0 else float('inf'):.2f} GB/s"
                 for n, (a, b) in self.fits.items()]
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
        sizes = np.array(PROBE_BYTES, dtype=float)
        return {n: _fit(sizes, np.array(t)) for n, t in times.items()}

    def _key(self) -> dict:
        from mpi4py import MPI

        w = self.world
        return {"size": w.size, "n_nodes": w.n_nodes,
                "local_sizes": sorted(w.comm.allgather(w.local_size)), "dtype": self.device.dtype.name,
                "device": self.device.name, "mpi": MPI.Get_library_version().splitlines()[0].strip(),
                "candidates": self.names, "probe_bytes": list(PROBE_BYTES)}


def _fit(sizes, times) -> tuple[float, float]:
    """Least-squares alpha + beta * n, clipped at 0 (noise can make either negative)."""
    beta, alpha = np.polyfit(sizes, times, 1)
    return max(float(alpha), 0.0), max(float(beta), 1e-15)


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
    return {n: tuple(v) for n, v in doc["fits"].items()}


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
