"""The device path of the compressed sum: error feedback, encoding and decoding on the GPU.

``DeviceCompressedSum(comm, compressor, device)(view, ctx, shapes)`` does to a CUDA bucket (float32
or float64) what :class:`~hpctrain.compress.reducer.CompressedSum` does to a host vector, and writes
the sum into ``view``; collective over ``comm``. Residuals (and PowerSGD's Q) live on the device;
only payloads cross to the host, where MPI moves them, and every kernel and copy is queued on the
device's stream, synchronised before each MPI call. On the host remain what is the reduction
itself or small: the 16-bit ring's per-hop sums (fp16, bf16), random-k's indices, top-k's exact
pick among its at most 4k + 64 candidates and its index packing, PowerSGD's QR of P in float64.
The per-compressor pipelines are tabled in docs/dist.md ("Where compression runs").

Results are bitwise the host path's for every compressor but powersgd (NaN payload bits aside),
whose GEMMs sum in another order (float32 rounding). ``state()`` copies the device state to the
host under the host path's keys and ``load_state()`` uploads host arrays at first use, so
checkpoints move between the paths. ``Fp16.saturated`` (a host-path diagnostic) is not counted here.
"""

from __future__ import annotations

import time

import numpy as np

from ..kernels import ef, gather_scatter, quantize16, sign_pack
from ..kernels.linear import gemm_cuda
from ..kernels.support.lazy_import import lazy_import
from ..kernels.topk_threshold import topk_cuda
from .base import NoCompression
from .quantize import Bf16, Fp16
from .reducer import CompressedSum
from .sign import Sign
from .sparse import RandK, TopK, k_of, pack_indices, payload_indices

cuda = lazy_import("numba.cuda")  # imported at the first launch

F32 = np.float32


class DeviceCompressedSum(CompressedSum):
    """CompressedSum over a :class:`~hpctrain.device.cuda.CudaDevice` bucket. Collective."""

    def __init__(self, comm, compressor, device):
        if not isinstance(compressor, (NoCompression, Fp16, Bf16, RandK, TopK, Sign)) \
                and compressor.combine != "lowrank":
            raise TypeError(f"no device path for compressor {compressor.describe()}")
        super().__init__(comm, compressor)
        self.device = device
        self.s = dict(stream=device.stream)
        self.arrays: dict = {}     # state key -> device array (a host array until first use after load_state)
        self._pinned: dict = {}
        self._kept: dict = {}      # state key -> device buffer that snapshot() copies into (reused)
        self.topk_passes = self.topk_fallbacks = 0   # threshold compactions and whole-vector fallbacks, summed

    def __call__(self, view, ctx, shapes=None):
        n = view.size
        x = view.reshape(n)
        self.dense_bytes = self.allreduce_bytes(4 * n)
        if self.c.combine == "lowrank":
            return self._lowrank_device(x, ctx, shapes or [(n,)])
        self.encode_s = self.decode_s = 0.0
        t0 = time.perf_counter()
        payload, idx = self._encode(x, ctx)
        self.encode_s += time.perf_counter() - t0
        if self.c.combine == "gather":
            parts = self._allgather(payload)
            t0 = time.perf_counter()
            self._decode_gathered(parts, x)
        else:
            summed = self._sum_payload(payload)
            t0 = time.perf_counter()
            self._decode_summed(summed, x, idx)
        self.device.synchronize()
        self.decode_s += time.perf_counter() - t0
        return view

    # ---- encoding: error feedback and the payload ----------------------------------------
    def _encode(self, x, ctx):
        """(host payload, device indices or None) for x; updates the bucket's residual."""
        c, n, s = self.c, x.size, self.s
        if not c.error_feedback:                       # none
            values = self._scratch("values", (n,), F32)
            ef.cast_copy_cuda(x, values, **s)
            return {"values": self._fetch(values, "values")}, None
        r = self._array(f"residual/{ctx.bucket}", (n,))
        if isinstance(c, (Fp16, Bf16)):
            bits = quantize16.encode_ef_cuda(x, r, self._scratch("bits16", (n,), np.uint16),
                                             quantize16.FORMATS[c.name], **s)
            return {"values": self._fetch(bits, "bits16")}, None
        if isinstance(c, Sign):
            scales = self._scratch("scales", (-(-n // c.chunk),), F32)
            sign_pack.chunk_scales_ef_cuda(x, r, c.chunk, scales, **s)
            bits = sign_pack.pack_ef_cuda(r, scales, c.chunk, self._scratch("bits1", (-(-n // 8),), np.uint8), **s)
            return {"bits": self._fetch(bits, "bits1"), "scales": self._fetch(scales, "scales")}, None
        ef.ef_correct_cuda(x, r, **s)
        if isinstance(c, RandK):
            indices = c.indices(n, ctx)
        else:
            found = topk_cuda(r, k_of(c.ratio, n), stream=self.device.stream, scratch=self.device.scratch)
            indices = found.indices
            self.topk_passes += found.passes
            self.topk_fallbacks += found.fallback
        idx = self.device.upload(indices, ("compress", "idx"), np.int32)
        values = gather_scatter.sparse_take_cuda(r, idx, self._scratch("values", (indices.size,), F32), **s)
        values = self._fetch(values, "values")
        if isinstance(c, RandK):
            return {"values": values}, idx
        return {**pack_indices(indices, n), "values": values}, idx

    # ---- decoding into the bucket ----------------------------------------------------------
    def _decode_summed(self, summed, out, idx):
        c, s, up = self.c, self.s, self._upload
        values = summed["values"]
        if isinstance(c, (Fp16, Bf16)):                # the ring's final 16-bit sums
            quantize16.decode_cuda(up(values, "bits16"), out, quantize16.FORMATS[c.name], **s)
        elif isinstance(c, RandK):
            ef.fill_cuda(out, 0, **s)
            gather_scatter.sparse_scatter_cuda(out, idx, up(values, "values"), **s)
        else:
            ef.cast_copy_cuda(up(values, "values"), out, **s)

    def _decode_gathered(self, parts, out):
        c, s, up = self.c, self.s, self._upload
        if isinstance(c, Sign):
            bits, scales = (up(np.stack([p[k] for p in parts]), k) for k in ("bits", "scales"))
            sign_pack.unpack_sum_cuda(bits, scales, c.chunk, out, **s)
            return
        # topk: 0 + rank 0's values + rank 1's ... at each index, as the host's dense sum
        idx = up(np.stack([payload_indices(p) for p in parts]).astype(np.int32), "indices")
        values = up(np.stack([p["values"] for p in parts]), "values")
        total = out if out.dtype == F32 else self._scratch("total", (out.size,), F32)
        ef.fill_cuda(total, 0, **s)
        for rank in range(len(parts)):   # one launch per rank: the additions keep rank order
            gather_scatter.sparse_scatter_cuda(total, idx[rank], values[rank], accumulate=True, **s)
        if total is not out:
            ef.cast_copy_cuda(total, out, **s)

    # ---- PowerSGD: the products on the device, the QR on the host -------------------------
    def _lowrank_device(self, x, ctx, shapes):
        c, s = self.c, self.s
        sizes = [int(np.prod(shape)) for shape in shapes]
        if sum(sizes) != x.size:
            raise ValueError(f"layer shapes cover {sum(sizes)} elements, the bucket has {x.size}")
        self.sent_bytes = 0
        comm_s = [0.0]
        allreduce_sum = self._allreduce_sum(comm_s)
        t0 = time.perf_counter()
        at = 0
        for layer, (shape, size) in enumerate(zip(shapes, sizes)):
            g = x[at:at + size]
            at += size
            if ctx.step < c.start_step or not c.compresses(shape):    # all-reduced as it is
                buf = ef.cast_copy_cuda(g, self._scratch("layer", (size,), F32), **s)
                ef.cast_copy_cuda(self._upload(allreduce_sum(self._fetch(buf, "layer")), "layer"), g, **s)
                continue
            n, k, cols = c.parts(shape)
            m, r = k * cols, min(c.rank, n, cols)
            key = f"{ctx.bucket}/{layer}"
            mat = self._array(f"residual/{key}", (n, m))
            q = self._array(f"q/{key}", (m, r), lambda: c.initial_q(ctx, layer, m, r))
            ef.ef_correct_cuda(g, mat, **s)                                   # M_i = gradient + residual
            # k parts: each GEMM takes the parts' Q's as one block-diagonal m x kr matrix, so
            # M [Q_1 .. Q_k] gives every part's P side by side (k = 1: Q itself)
            q_wide = q if k == 1 else self._upload(_block_diagonal(self._fetch(q, "q_host"), k), "q_wide")
            p = gemm_cuda(mat, q_wide, self._scratch("p", (n, k * r), F32), **s)
            p = allreduce_sum(self._fetch(p, "p"))                             # P = sum_i M_i Q
            p_hat = self._upload(c.orthonormal_parts(p, k, r), "p_hat")
            q_new = gemm_cuda(mat, p_hat, self._scratch("q", (m, k * r), F32), trans_a=True, **s)
            q_new = self._fetch(q_new, "q")
            if k > 1:  # each part's own M_j^T P^_j: the diagonal blocks
                q_new = np.concatenate([q_new[j * cols:(j + 1) * cols, j * r:(j + 1) * r] for j in range(k)])
            q_sum = allreduce_sum(q_new)                                       # Q = sum_i M_i^T P^
            q.copy_to_device(q_sum, **s)
            q_wide = q if k == 1 else self._upload(_block_diagonal(q_sum, k), "q_wide")
            approx = gemm_cuda(p_hat, q_wide, self._scratch("approx", (n, m), F32), trans_b=True, **s)
            ef.lowrank_residual_cuda(mat, approx, self.size, **s)             # M_i - P^ Q^T / p
            ef.cast_copy_cuda(approx, g, **s)
        self.device.synchronize()
        # the products and the QR: PowerSGD's whole compute, its two all-reduces taken out
        self.encode_s, self.decode_s = time.perf_counter() - t0 - comm_s[0], 0.0
        return x

    # ---- memory ------------------------------------------------------------------------------
    def _array(self, key, shape, init=None):
        """Device state ``key`` of ``shape``: kept, uploaded from a loaded state, or new (zeros, or init())."""
        a = self.arrays.get(key)
        if a is None or tuple(a.shape) != tuple(shape):
            a = init() if init is not None else np.zeros(shape, F32)
        if isinstance(a, np.ndarray):
            a = self.arrays[key] = self.device.from_host(a, F32)
        return a

    def _scratch(self, name, shape, dtype):
        return self.device.scratch(("compress", name), shape, dtype)

    def _upload(self, host, name):
        return self.device.upload(host, ("compress", name), host.dtype)

    def _fetch(self, a, name):
        """Device array -> its pinned host buffer (one per name and shape, reused); waits for the copy."""
        key = (name, tuple(a.shape), np.dtype(a.dtype).str)
        host = self._pinned.get(key)
        if host is None:
            host = self._pinned[key] = cuda.pinned_array(a.shape, dtype=a.dtype)
        a.copy_to_host(host, stream=self.device.stream)
        self.device.synchronize()
        return host

    def state(self) -> dict:
        """Residuals (and PowerSGD's Q) on the host, under the host path's keys."""
        return {k: v if isinstance(v, np.ndarray) else self.device.to_host(v) for k, v in sorted(self.arrays.items())}

    def snapshot(self):
        """A copy of the state where it lives: device arrays copied on the device into buffers kept
        for it (no host round trip, no allocation after the first), for :meth:`restore`."""
        out = {}
        for k, a in self.arrays.items():
            if isinstance(a, np.ndarray):
                out[k] = a.copy()
                continue
            buf = self._kept.get(k)
            if buf is None or tuple(buf.shape) != tuple(a.shape):
                buf = self._kept[k] = self.device.empty(a.shape, a.dtype)
            buf.copy_to_device(a, stream=self.device.stream)
            out[k] = buf
        return out

    def restore(self, snapshot) -> None:
        """The state :meth:`snapshot` copied, taken over in place: each device array swaps with its
        copy (the swapped-out one becomes the next snapshot's buffer); state made since is dropped."""
        for k, a in snapshot.items():
            if not isinstance(a, np.ndarray):
                self._kept[k] = self.arrays[k]
        self.arrays = dict(snapshot)

    def load_state(self, state: dict) -> None:
        self.arrays = {k: np.asarray(v, F32).copy() for k, v in state.items()
                       if k.startswith("residual/") or (k.startswith("q/") and self.c.combine == "lowrank")}


def _block_diagonal(q, k: int) -> np.ndarray:
    """The k parts' Q's, stacked in ``q`` (kc x r), as one block-diagonal kc x kr matrix."""
    c, r = q.shape[0] // k, q.shape[1]
    out = np.zeros((k * c, k * r), F32)
    for j in range(k):
        out[j * c:(j + 1) * c, j * r:(j + 1) * r] = q[j * c:(j + 1) * c]
    return out
