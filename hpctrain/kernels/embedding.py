"""Token + position embedding (GPT-2's encoder): the first op of the model.

tokens (B, T) integer ids in [0, V), wte (V, C) token table, wpe (Tmax, C) position table with
T <= Tmax, out (B, T, C), one float dtype:

forward:  out[b, t] = wte[tokens[b, t]] + wpe[t]
backward: dwpe[t] <- (dwpe[t] +) sum over b of dout[b, t] for t < T, in float64 in b order (rows
          T..Tmax-1 zeroed unless ``accumulate``); dwte[tokens[b, t]] += dout[b, t], always added
          (the tied LM head, first in backward, has already written its gradient there).

dwte is summed in (b, t) order, with no float atomics, so a repeated token gives the same bits on
every run: the twin in a serial loop, the CUDA kernels by bucketing positions by id on the device
(integer atomics), sorting each bucket and adding one (id, channel) per thread; their bits are the
twin's. The twin raises ValueError for an id outside [0, V); on CUDA ids are not checked (a stream
sync; the data file's were when it was opened), and such an id reads nothing outside wte: forward
writes NaN into its row (the trainer's non-finite guard stops the step) and backward drops it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .support.cuda_support import THREADS, blocks_for, configured, configured_elementwise
from .support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.embedding_cuda")  # the CUDA kernels launched here (imported at the first launch)


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True, nogil=True)
def _embedding_forward(tokens, wte, wpe, out):
    # returns the flat index of the first id outside [0, V), or -1: numba does
    # not bounds-check, so a bad id would read another row (or another array)
    B, T = tokens.shape
    V, C = wte.shape
    for b in range(B):
        for t in range(T):
            tok = tokens[b, t]
            if tok < 0 or tok >= V:
                return b * T + t
            for c in range(C):
                out[b, t, c] = wte[tok, c] + wpe[t, c]
    return -1


@njit(cache=True, nogil=True)
def _embedding_backward(dout, tokens, dwte, dwpe, accumulate):
    B, T, C = dout.shape
    V = dwte.shape[0]
    for b in range(B):  # validate first: nothing is written when an id is bad
        for t in range(T):
            if tokens[b, t] < 0 or tokens[b, t] >= V:
                return b * T + t
    # position gradient: column sums over the batch in float64, b in order
    sums = np.zeros((T, C))
    for b in range(B):
        for t in range(T):
            for c in range(C):
                sums[t, c] += dout[b, t, c]
    for t in range(T):
        for c in range(C):
            dwpe[t, c] = dwpe[t, c] + sums[t, c] if accumulate else sums[t, c]
    if not accumulate:
        for t in range(T, dwpe.shape[0]):
            for c in range(C):
                dwpe[t, c] = 0.0
    # token gradient: serial scatter-add in (b, t) order (deterministic bits)
    for b in range(B):
        for t in range(T):
            tok = tokens[b, t]
            for c in range(C):
                dwte[tok, c] += dout[b, t, c]
    return -1


def _check_shapes(tokens, wpe_rows, op):
    if tokens.ndim != 2:
        raise ValueError(f"{op}: tokens must be (B, T), got shape {tokens.shape}")
    if tokens.shape[1] > wpe_rows:
        raise ValueError(f"{op}: T={tokens.shape[1]} positions exceed the context of {wpe_rows} "
                         f"(wpe rows); shorten the sequences or enlarge the model's context")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{op}: tokens must be integers, got {tokens.dtype}")


def _bad_token(tokens, flat_index, V, op):
    b, t = divmod(int(flat_index), tokens.shape[1])
    return ValueError(f"{op}: token id {int(tokens[b, t])} at (b={b}, t={t}) is outside the "
                      f"vocabulary [0, {V}); the data and the model's vocab_size disagree")


def embedding_forward(tokens, wte, wpe, out):
    """out (B, T, C) <- wte[tokens] + wpe[:T]. Returns out.

    tokens (B, T) any integer dtype; wte (V, C), wpe (Tmax, C), out share one
    float dtype. Raises ValueError for T > Tmax or an id outside [0, V).
    """
    _check_shapes(tokens, wpe.shape[0], "embedding_forward")
    bad = _embedding_forward(tokens, wte, wpe, out)
    if bad >= 0:
        raise _bad_token(tokens, bad, wte.shape[0], "embedding_forward")
    return out


def embedding_backward(dout, tokens, dwte, dwpe, accumulate=False):
    """dwte[tokens[b, t]] += dout[b, t] (always); dwpe (Tmax, C) <- (dwpe +) its gradient.

    dout (B, T, C). dwpe rows T..Tmax-1 are zeroed unless ``accumulate``.
    dwte always accumulates (the tied LM head wrote it first); the scatter is a
    serial loop in (b, t) order, so repeated tokens give identical bits on every
    run. dwpe's batch sums accumulate in float64. Returns None.
    """
    _check_shapes(tokens, dwpe.shape[0], "embedding_backward")
    bad = _embedding_backward(dout, tokens, dwte, dwpe, bool(accumulate))
    if bad >= 0:
        raise _bad_token(tokens, bad, dwte.shape[0], "embedding_backward")


# ---- launchers ---------------------------------------------------------------------
def embedding_forward_cuda(tokens, wte, wpe, out, *, stream=0):
    """As :func:`embedding_forward`, on ``stream``; tokens (B, T) int64 on the device. Returns out.

    Shapes are checked on the host; an id outside [0, V) is not reported (a
    stream sync) but gets a NaN output row, so the loss turns NaN.
    """
    _check_shapes(tokens, wpe.shape[0], "embedding_forward")
    B, T = tokens.shape
    launch = configured_elementwise(kernels.embedding_forward_kernel, B * T * wte.shape[1], stream)
    launch(tokens, wte, wpe, out)
    return out


def embedding_backward_cuda(dout, tokens, dwte, dwpe, accumulate=False, *, stream=0, scratch):
    """As :func:`embedding_backward`, on ``stream``, with the twin's bits; returns None.

    ``scratch(key, shape, dtype)`` lends reusable device arrays (int32 bucket
    counts and offsets (V + 1,), two position lists (B T,)). An id outside
    [0, V) is dropped from dwte (forward made that row, and so the loss, NaN).
    """
    _check_shapes(tokens, dwpe.shape[0], "embedding_backward")
    B, T = tokens.shape
    V, C = dwte.shape
    N = B * T
    if N >= 2 ** 31:
        raise ValueError(f"embedding_backward: B*T={N} positions overflow int32 buckets; split the batch")
    configured_elementwise(kernels.dwpe_kernel, dwpe.shape[0] * C, stream)(dout, dwpe, bool(accumulate))
    counts = scratch("embed_counts", (V,), np.int32)
    offsets = scratch("embed_offsets", (V + 1,), np.int32)
    placed = scratch("embed_placed", (max(N, 1),), np.int32)
    order = scratch("embed_order", (max(N, 1),), np.int32)
    configured_elementwise(kernels.zero_counts_kernel, V, stream)(counts)
    configured(kernels.count_tokens_kernel, blocks_for(N), THREADS, stream)(tokens, counts)
    configured(kernels.bucket_offsets_kernel, 1, THREADS, stream)(counts, offsets)
    configured(kernels.place_positions_kernel, blocks_for(N), THREADS, stream)(tokens, offsets, counts, placed)
    configured(kernels.sort_buckets_kernel, blocks_for(N), THREADS, stream)(tokens, offsets, placed, order)
    grid = (blocks_for(V, 1), -(-C // kernels.TOKEN_THREADS))
    # dout is contiguous: its reshape is a view
    configured(kernels.dwte_kernel, grid, kernels.TOKEN_THREADS, stream)(dout.reshape(N, C), offsets, order, dwte)
