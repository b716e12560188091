"""Fused softmax + cross-entropy, row-wise and numerically stable.

logits (B, C) float, labels (B,) int64, probs (B, C) saved for backward.
Forward returns (sum of per-row losses, number of rows whose argmax is the
label) so that ranks can add them up; the mean loss is their sum / B.
"""

import math

import numpy as np
from numba import njit


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True)
def _softmax_xent_forward(logits, labels, probs):
    loss_sum = 0.0
    correct = 0
    B, C = logits.shape
    for r in range(B):
        # subtracting the row max keeps exp() from overflowing
        best = 0
        m = logits[r, 0]
        for c in range(1, C):
            if logits[r, c] > m:
                m = logits[r, c]
                best = c
        s = 0.0
        for c in range(C):
            e = math.exp(logits[r, c] - m)
            probs[r, c] = e
            s += e
        inv = 1.0 / s
        for c in range(C):
            probs[r, c] *= inv
        y = labels[r]
        loss_sum += math.log(s) + m - logits[r, y]
        if best == y:
            correct += 1
    return loss_sum, correct


@njit(cache=True)
def _softmax_xent_backward(probs, labels, scale, dlogits):
    B, C = probs.shape
    for r in range(B):
        for c in range(C):
            dlogits[r, c] = probs[r, c] * scale
        dlogits[r, labels[r]] -= scale


def softmax_xent_forward(logits, labels, probs):
    """probs <- softmax(logits); returns (loss_sum: float, correct: int) over the B rows."""
    loss_sum, correct = _softmax_xent_forward(logits, labels, probs)
    return float(loss_sum), int(correct)


def softmax_xent_backward(probs, labels, scale, dlogits):
    """dlogits <- scale * (probs - onehot(labels)); scale = 1/B for a mean loss."""
    _softmax_xent_backward(probs, labels, np.float64(scale), dlogits)
    return dlogits
