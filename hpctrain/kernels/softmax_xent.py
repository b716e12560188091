"""Fused softmax + cross-entropy, row-wise and numerically stable.

logits (B, C) float, labels (B,) int64, probs (B, C) saved for backward.
Forward returns (sum of per-row losses, number of rows whose argmax is the
label) so that ranks can add them up; the mean loss is their sum / B. Ties in
the argmax go to the first (lowest) class, as ``np.argmax``. On the GPU both
numbers are reduced on the device and only those two scalars reach the host.
Each row's sum of exponentials accumulates in float64 (C terms; float32 would
lose log2(C) bits) and normalises in float64, each probability rounded once on
store; exp and the backward's scaling run in the logits' dtype (float32 stays
float32: the backward's scale is passed in that dtype).

Training uses the fused op (:func:`softmax_xent_fused`, llm.c's "fused classifier"): the
forward also writes ``dlogits = scale * (softmax - onehot)``, over the logits themselves when
given them, so no probabilities are kept and backward has nothing left to do. It computes
each value by the same steps, rounded the same way, as forward then backward: the same bits,
in one kernel and one buffer instead of two of each.
"""

import math

import numpy as np
from numba import njit

from .support import cpu_threads
from .support.cpu_exp import fast_exp
from .support.cuda_support import THREADS, blocks_for, configured, configured_elementwise
from .support.lazy_import import lazy_import

cuda = lazy_import("numba.cuda")  # imported at the first launch
kernels = lazy_import(f"{__package__}.softmax_xent_cuda")  # the CUDA kernels launched here (imported at the first launch)


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True, nogil=True)
def _sum4(x):
    """float64 sum of x in four chains (lane u % 4, combined (0 + 1) + (2 + 3)): a fixed order, and
    the adder kept busy."""
    n = x.shape[0]
    s0 = s1 = s2 = s3 = 0.0
    u = 0
    while u + 4 <= n:
        s0 += x[u]
        s1 += x[u + 1]
        s2 += x[u + 2]
        s3 += x[u + 3]
        u += 4
    while u < n:
        s0 += x[u]
        u += 1
    return (s0 + s1) + (s2 + s3)


@njit(cache=True, nogil=True, error_model="numpy")  # no zero-divisor test: the loop vectorises
def _softmax_xent_rows(logits, labels, scale, out, fused, partials, c0, c1, chunk_rows):
    # Chunks c0..c1 of chunk_rows rows; partials[c] <- chunk c's (loss sum, correct count).
    # fused=False: out <- softmax(logits) (forward's probs; scale unused);
    # fused=True: out <- scale * (softmax - onehot), and out may be logits: a row's max and label
    # logit are read first and its exponentials kept in ``e``, so the row is read once before
    # it is written. exp is cpu_exp.fast_exp (vectorised; e is a separate buffer, so the loop
    # does not fall back to scalar code when out is logits).
    B, C = logits.shape
    e = np.empty(C, logits.dtype)
    for ch in range(c0, c1):
        loss_sum = 0.0
        correct = 0
        for r in range(ch * chunk_rows, min(B, (ch + 1) * chunk_rows)):
            # subtracting the row max keeps exp() from overflowing
            best = 0
            m = logits[r, 0]
            for c in range(1, C):
                if logits[r, c] > m:
                    m = logits[r, c]
                    best = c
            y = labels[r]
            label_logit = logits[r, y]
            for c in range(C):
                e[c] = fast_exp(logits[r, c] - m)
            s = _sum4(e)
            loss_sum += math.log(s) + m - label_logit
            if best == y:
                correct += 1
            inv = 1.0 / s
            for c in range(C):
                if fused:  # two stores, each rounding to the dtype as forward's probs and backward's product did
                    out[r, c] = e[c] * inv
                    out[r, c] = out[r, c] * scale
                else:
                    out[r, c] = e[c] * inv
            if fused:
                out[r, y] -= scale
        partials[ch, 0] = loss_sum
        partials[ch, 1] = correct


@njit(cache=True, nogil=True)
def _softmax_xent_backward(probs, labels, scale, dlogits):
    B, C = probs.shape
    for r in range(B):
        for c in range(C):
            dlogits[r, c] = probs[r, c] * scale
        dlogits[r, labels[r]] -= scale


_NS_ROWS, _NS_BACKWARD = 1.5, 0.3  # ns per element on one core (2-core EPYC, float32): whether a split pays


def _check_labels(labels, classes: int) -> None:
    """ValueError unless every label is a class index (the kernels index rows by them: one out of
    range would read, and write, outside its row)."""
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise ValueError(f"softmax_xent: labels must be in [0, {classes}); got {labels.min()}..{labels.max()}")


def _rows_split(logits, labels, scale, out, fused):
    """:func:`_softmax_xent_rows` over chunks of rows split over the CPU threads: the loss sum is the
    chunks' float64 partial sums added in chunk order (the same at any thread count)."""
    _check_labels(labels, logits.shape[1])
    partials = np.zeros((cpu_threads.chunks_of(logits.shape[0]), 2))
    cpu_threads.for_chunks(lambda c0, c1: _softmax_xent_rows(logits, labels, scale, out, fused, partials, c0, c1,
                                                             cpu_threads.CHUNK_ROWS),
                           logits.shape[0], logits.size, ns_per_element=_NS_ROWS)
    loss_sum, correct = cpu_threads.add_partials(partials)
    return float(loss_sum), int(correct)


def softmax_xent_fused(logits, labels, scale, dlogits):
    """dlogits <- scale * (softmax(logits) - onehot(labels)), ``dlogits`` may be ``logits``;
    returns (loss_sum, correct) as :func:`softmax_xent_forward`. The same bits as forward then
    backward with that scale."""
    return _rows_split(logits, labels, logits.dtype.type(scale), dlogits, True)


def softmax_xent_fused_add(logits, labels, scale, dlogits, totals, accumulate=False):
    """As :func:`softmax_xent_fused`, the two statistics written into ``totals`` (a float64 array
    [loss_sum, correct]), or added to it with ``accumulate``: the CUDA op keeps them on the device
    (a step reads them once), and this twin keeps the same contract."""
    loss_sum, correct = softmax_xent_fused(logits, labels, scale, dlogits)
    if accumulate:
        totals[0] += loss_sum
        totals[1] += correct
    else:
        totals[0], totals[1] = loss_sum, correct
    return totals


def softmax_xent_forward(logits, labels, probs):
    """probs <- softmax(logits); returns (loss_sum: float, correct: int) over the B rows."""
    return _rows_split(logits, labels, logits.dtype.type(1.0), probs, False)


def softmax_xent_backward(probs, labels, scale, dlogits):
    """dlogits <- scale * (probs - onehot(labels)); scale = 1/B for a mean loss."""
    t = probs.dtype.type(scale)
    _check_labels(labels, probs.shape[1])
    cpu_threads.for_rows(lambda lo, hi: _softmax_xent_backward(probs[lo:hi], labels[lo:hi], t, dlogits[lo:hi]),
                         probs.shape[0], probs.size, ns_per_element=_NS_BACKWARD)
    return dlogits


# ---- launchers ---------------------------------------------------------------------
def softmax_xent_totals_cuda(logits, labels, probs, *, stream=0, scratch, scale=1.0, fused=False, totals=None,
                             accumulate=False):
    """probs <- softmax(logits) (``fused``: ``probs`` <- the gradient at ``scale``, see
    :func:`.softmax_xent_cuda.rows_kernel`); returns a float64 device array [loss_sum, correct]: ``totals``, the sums
    written into it or, with ``accumulate``, added to it; None: a scratch array of the launcher's.

    Queued on ``stream``, nothing copied to the host (the benchmark times this).
    """
    B, _ = logits.shape
    row_loss = scratch("xent_row_loss", (B,), np.float64)
    row_correct = scratch("xent_row_correct", (B,), np.float64)
    if totals is None:
        totals = scratch("xent_totals", (2,), np.float64)
    kernel = kernels.rows_kernel(np.dtype(logits.dtype).name, fused)
    launch = configured(kernel, blocks_for(B, 1), kernels.ROW_THREADS, stream)
    launch(logits, labels, logits.dtype.type(scale), probs, row_loss, row_correct)
    configured(kernels.sum_rows_kernel, 1, THREADS, stream)(row_loss, row_correct, totals, accumulate)
    return totals


def _to_host(totals, stream):
    host = totals.copy_to_host(stream=stream)
    stream_sync(stream)  # before reading: the copy is only ordered on the stream
    return float(host[0]), int(host[1])


def softmax_xent_forward_cuda(logits, labels, probs, *, stream=0, scratch):
    """As :func:`softmax_xent_forward`; copies the two totals to the host (a stream sync)."""
    return _to_host(softmax_xent_totals_cuda(logits, labels, probs, stream=stream, scratch=scratch), stream)


def softmax_xent_fused_cuda(logits, labels, scale, dlogits, *, stream=0, scratch):
    """As :func:`softmax_xent_fused` (``dlogits`` may be ``logits``); copies the two totals to the
    host (a stream sync)."""
    return _to_host(softmax_xent_totals_cuda(logits, labels, dlogits, stream=stream, scratch=scratch, scale=scale,
                                             fused=True), stream)


def softmax_xent_fused_add_cuda(logits, labels, scale, dlogits, totals, accumulate=False, *, stream=0, scratch):
    """As :func:`softmax_xent_fused_add`: the statistics stay on the device, in ``totals``; no sync."""
    return softmax_xent_totals_cuda(logits, labels, dlogits, stream=stream, scratch=scratch, scale=scale, fused=True,
                                    totals=totals, accumulate=accumulate)


def softmax_xent_backward_cuda(probs, labels, scale, dlogits, *, stream=0):
    B, C = probs.shape
    launch = configured_elementwise(kernels.softmax_xent_backward_kernel, B * C, stream)
    launch(probs, labels, probs.dtype.type(scale), dlogits)
    return dlogits


def stream_sync(stream):
    """Wait for ``stream`` (0 = the default stream)."""
    if stream:
        stream.synchronize()
    else:
        cuda.synchronize()
