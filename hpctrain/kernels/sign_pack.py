"""1-bit sign compression (hpctrain/compress/sign.py): chunk scales, bit packing, decoding.

n values in chunks of ``chunk`` (the last one may be short); nb = ceil(n / 8) bytes;
nc = ceil(n / chunk) chunks; p ranks.

  chunk_scales  c (n,) float32 -> scales (nc,) float32: mean |c| per chunk, summed in float64 in
                the order below, divided, rounded once to float32 (on the GPU, chunk_scales_ef_cuda
                first forms c = r <- float32(x) + r in the same pass; a block per chunk)
  pack_ef       c (n,), scales -> bits (nb,) uint8: bit 7 - (i % 8) of byte i // 8 set when
                c[i] < 0 (NumPy's packbits of c < 0; NaN and -0.0 are not negative); c becomes
                the residual c - (-s or +s)
  unpack_sum    bits (p, nb), scales (p, nc) -> out (n,) any float dtype: per element
                0 + d_0 + d_1 + ... in float32, rank order (d = -s or +s)

A chunk's sum is in the order a block of :data:`SUM_THREADS` threads takes: thread t adds elements
t, t + SUM_THREADS, ... in turn, then the partial sums fold in halves. The CPU twin runs exactly that
order, so the float64 sums, and the scales, have the same bits on both targets.
"""

import numpy as np
from numba import njit

from .support.cuda_support import blocks_for, configured, configured_elementwise
from .support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.sign_pack_cuda")  # the CUDA kernels launched here (imported at the first launch)

SUM_THREADS = 256      # threads per chunk on the GPU; also the twin's summation layout


# ---- CPU twins (numba) -------------------------------------------------------------
@njit(cache=True, nogil=True)
def _chunk_scales(c, chunk, scales):
    partial = np.empty(SUM_THREADS, np.float64)
    for b in range(scales.size):
        lo = b * chunk
        hi = min(lo + chunk, c.size)
        for t in range(SUM_THREADS):
            s = np.float64(0.0)
            for i in range(lo + t, hi, SUM_THREADS):
                s += abs(np.float64(c[i]))
            partial[t] = s
        half = SUM_THREADS // 2
        while half > 0:
            for t in range(half):
                partial[t] += partial[t + half]
            half //= 2
        scales[b] = np.float32(partial[0] / (hi - lo))


def chunk_scales(c, chunk, scales):
    """scales (ceil(n / chunk),) <- mean |c| per chunk (the documented float64 order)."""
    _chunk_scales(c, chunk, scales)
    return scales


@njit(cache=True, nogil=True)
def _pack_ef(c, scales, chunk, bits):
    for j in range(bits.size):
        byte = 0
        for lane in range(8):
            i = 8 * j + lane
            if i < c.size:
                s = scales[i // chunk]
                if c[i] < 0:
                    byte |= 128 >> lane
                    c[i] = c[i] - (-s)
                else:
                    c[i] = c[i] - s
        bits[j] = byte


def pack_ef(c, scales, chunk, bits):
    """bits <- packed signs of c; c <- c - decode (the residual)."""
    _pack_ef(c, scales, chunk, bits)
    return bits


@njit(cache=True, nogil=True)
def _unpack_sum(bits, scales, chunk, out):
    for i in range(out.size):
        acc = np.float32(0.0)
        for p in range(bits.shape[0]):
            s = scales[p, i // chunk]
            acc += -s if (bits[p, i >> 3] >> (7 - (i & 7))) & 1 else s
        out[i] = acc


def unpack_sum(bits, scales, chunk, out):
    """out <- the sum over ranks (rows, in order) of the decoded payloads."""
    _unpack_sum(bits, scales, chunk, out)
    return out


# ---- launchers ---------------------------------------------------------------------
def chunk_scales_ef_cuda(x, r, chunk, scales, *, stream=0):
    """r <- float32(x) + r, then scales <- mean |r| per chunk (as :func:`chunk_scales`)."""
    blocks = blocks_for(scales.size, threads=1)   # a block per chunk, up to the grid cap
    configured(kernels.chunk_scales_ef_kernel(SUM_THREADS), blocks, SUM_THREADS, stream)(x, r, chunk, scales)
    return scales


def pack_ef_cuda(c, scales, chunk, bits, *, stream=0):
    configured_elementwise(kernels.pack_ef_kernel, bits.size, stream)(c, scales, chunk, bits)
    return bits


def unpack_sum_cuda(bits, scales, chunk, out, *, stream=0):
    configured_elementwise(kernels.unpack_sum_kernel, out.size, stream)(bits, scales, chunk, out)
    return out
