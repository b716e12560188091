"""Compressed gradient buckets: ``dist.compress`` and ``dist.compress_scope`` (docs/dist.md).

``GradientCompression.reduce(view, index, step)`` sums one gradient bucket (a slice of the flat
device buffer) over ranks; collective. Before ``dist.compress_start_step`` it sums exactly through
the all-reduce strategy (compression's warm-up), then through the compressor:

  * scope "all": the whole bucket, over ``world.comm``, instead of the strategy; on a CUDA device
    on the device (:class:`~hpctrain.compress.device.DeviceCompressedSum`), else on the host in
    float32 (:class:`~hpctrain.compress.reducer.CompressedSum`);
  * scope "inter" (hierarchical only): only each rank's chunk crossing the node boundary
    (hierarchical's phase 2), on the host; on one node nothing is compressed.

Momentum correction (``dist.compress_momentum``) always takes the host path: the device kernels
keep no velocity. With ``keep_undo`` (``guard.nonfinite = "skip"``) ``begin_step`` copies the
per-rank state and ``undo_step`` puts it back. ``state()`` gives that state (residuals, PowerSGD's Q,
velocities) as host arrays under the same keys on either path, so checkpoints move between them.
"""

from __future__ import annotations

import numpy as np

from ..comm.buckets import layout_signature
from ..errors import ConfigError
from . import Context, make_compressor
from .device import DeviceCompressedSum
from .reducer import CompressedSum


class GradientCompression:
    def __init__(self, spec, scope, world, staging, strategy, buckets, flat, seed, log=None, start_step=0,
                 momentum=0.0, keep_undo=False, matrix_parts=None):
        self.world, self.staging, self.strategy, self.seed = world, staging, strategy, seed
        self.compressor = make_compressor(spec)
        self.scope, self.start_step = scope, start_step
        self.keep_undo, self._undo = keep_undo, None
        by_name = {s.name: s for s in flat.slots}
        # layer shapes in memory order (buckets list their parameters in reverse); a parameter of
        # k matrices side by side (the model's matrix_parts) as (n, k, m / k), PowerSGD's parts
        parts = matrix_parts or {}
        self.shapes = [[_layer_shape(by_name[n].shape, parts.get(n, 1)) for n in reversed(b.slots)]
                       for b in buckets]
        self.layout = layout_signature(buckets, "")   # a checkpoint's rows are per bucket: restored only onto these
        self.sent_bytes = self.dense_bytes = 0
        self.encode_s = self.decode_s = 0.0
        self._sum = None
        self.on_device = scope != "inter" and staging.device.name == "cuda" and not momentum
        if momentum and staging.device.name == "cuda" and log is not None:
            log.info("compression: momentum correction runs on the host path (the device kernels keep no "
                     "velocity): each bucket is copied to the host and back")
        if scope == "inter":
            if not hasattr(strategy, "compress_inter"):
                raise ConfigError("dist.compress_scope = 'inter' needs dist.allreduce = 'hierarchical' "
                                  "(it compresses only hierarchical's cross-node phase); use scope 'all'")
            if self.compressor.combine == "lowrank":
                raise ConfigError("powersgd compresses whole layers, but scope 'inter' hands it slices of "
                                  "buckets; use dist.compress_scope = 'all' with powersgd")
            compressor = self.compressor
            strategy.compress_inter(lambda comm: CompressedSum(comm, compressor, momentum))
            self._sum = strategy.cross_compressed
            if world.n_nodes == 1 and momentum:
                raise ConfigError("dist.compress_momentum with dist.compress_scope = 'inter' on a single node: "
                                  "nothing crosses a node, so no velocity would be summed and the optimizer "
                                  "would take plain gradients for its first moment; use scope 'all', or run on "
                                  "several nodes")
            if world.n_nodes == 1 and log is not None:
                log.info("compression: scope inter on a single node: nothing crosses a node, nothing is compressed")
        elif self.on_device:
            self._sum = DeviceCompressedSum(world.comm, self.compressor, staging.device)
        else:
            self._sum = CompressedSum(world.comm, self.compressor, momentum)

    def begin_step(self):
        """A new step: counters to zero; with ``keep_undo`` a copy of the state for :meth:`undo_step`."""
        self.sent_bytes = self.dense_bytes = 0
        self.encode_s = self.decode_s = 0.0
        if self.keep_undo and self._sum is not None:
            self._undo = None  # the last step's copy goes first: one copy at a time
            self._undo = self._sum.snapshot()

    def undo_step(self) -> None:
        """Per-rank state back to what :meth:`begin_step` found: the guard skipped this step, whose
        residuals and velocities hold its bad gradient."""
        if self._sum is None:
            return
        if self._undo is None:
            raise RuntimeError("undo_step without a state kept by begin_step (GradientCompression(keep_undo=True))")
        self._sum.restore(self._undo)
        self._undo = None

    def reduce(self, view, index: int, step: int) -> None:
        """Replace bucket ``index`` (device slice ``view``) by its compressed sum over ranks, or before
        ``start_step`` by its plain sum through the all-reduce strategy. Collective."""
        if step < self.start_step:
            self._reduce_uncompressed(view)
            return
        ctx = Context(step=step, bucket=index, seed=self.seed)
        if self.scope == "inter":
            self.strategy.compress_context = ctx
            try:
                self.strategy(view, "sum")
            finally:
                self.strategy.compress_context = None  # no stale context for an uncompressed call
        elif self.on_device:
            self._sum(view, ctx, self.shapes[index])
        else:
            with self.staging.host_view(view) as host:
                flat = host.reshape(-1)
                x = flat.astype(np.float32)
                self._sum(x, ctx, self.shapes[index])
                flat[:] = x
        s = self._sum
        if s is not None:
            self.sent_bytes += s.sent_bytes
            self.dense_bytes += s.dense_bytes
            self.encode_s += s.encode_s
            self.decode_s += s.decode_s

    def _reduce_uncompressed(self, view) -> None:
        """Compression's warm-up (``dist.compress_start_step``): the bucket summed exactly by the
        strategy (hierarchical's phase 2 too: no context, no compression, its usual segments).
        Sent and dense bytes are both the compressed path's yardstick, a bandwidth-optimal
        all-reduce of the float32 bucket (of this rank's phase-2 chunk with scope inter)."""
        self.strategy(view, "sum")
        if self._sum is None:  # scope inter on one node, or a rank outside phase 2: nothing crosses
            return
        n = self.strategy.cross_chunk(view) if self.scope == "inter" else view.size
        dense = self._sum.allreduce_bytes(4 * n)
        self.sent_bytes += dense
        self.dense_bytes += dense

    @property
    def ratio(self):
        """dense / sent bytes of this step; None when nothing was sent (1 rank, or scope inter on one node)."""
        return self.dense_bytes / self.sent_bytes if self.sent_bytes else None

    def state(self) -> dict:
        return self._sum.state() if self._sum is not None else {}

    def load_state(self, state: dict) -> None:
        if self._sum is not None:
            self._sum.load_state(state)


def _layer_shape(shape, k: int) -> tuple:
    """A parameter's shape as the compressor sees it: (n, k, m / k) for k > 1 matrices side by side."""
    if k == 1:
        return tuple(shape)
    n, m = shape
    if m % k:
        raise ValueError(f"a parameter of shape {tuple(shape)} is not {k} matrices side by side")
    return n, k, m // k
