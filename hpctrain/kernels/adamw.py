"""AdamW (decoupled weight decay, PyTorch semantics) over flat buffers of P elements.

p *= 1 - lr * wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)     (t = step, from 1)
Frozen at F > 0 (1-bit Adam's frozen variance, Tang et al. 2021): v keeps its value and its
bias correction is 1 - b2^F; the update is then linear in g, which is what error-feedback
compression needs (docs/dist.md). The optimizer decides when (optim.freeze_step).
Velocity mode (momentum correction, ``dist.compress_momentum``): g is the ranks' summed velocities,
sum_s (1-b1) b1^(t-s) g_s over the steps since compression started, so m only decays (m = b1 m,
what remains of the first moment from before) and the update uses m + g, which is Adam's first
moment again, with its usual bias correction.
The per-element update is one plain function compiled for both targets; the
bias corrections, 1 - lr wd, 1 - b1 and 1 - b2 are computed once per step on the
host in float64 and rounded once to the parameters' dtype (:func:`hyperparameters`), so float32
buffers are updated in float32 arithmetic (no float64 literal or scalar promotes it).

The op (``adamw_update``) reads those eight numbers from an array (``hyper``), not from its
arguments: on a GPU it lives in device memory, refilled once per step by an upload, so a step's
launches are the same every step and a CUDA graph can replay them (training/cuda_graphs.py).
"""

import math

import numpy as np
from numba import njit

from .support import cpu_threads
from .support.cuda_support import configured_elementwise
from .support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.adamw_cuda")  # the CUDA kernels launched here (imported at the first launch)


def _update(p, g, m, v, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, inv_sqrt_bc2,
            velocity):
    """One element: returns the new (p, m, v); ``velocity``: g is a velocity (module doc)."""
    p = p * decay
    if velocity:
        m = beta1 * m
        first = m + g
    else:
        m = beta1 * m + one_minus_beta1 * g
        first = m
    v = beta2 * v + one_minus_beta2 * g * g
    return p - step_size * first / (math.sqrt(v) * inv_sqrt_bc2 + eps), m, v


_update_cpu = njit(_update)   # the GPU's compile of it: adamw_cuda.adamw_update_kernel


HYPER = 8  # the length of ``hyper``: decay, beta1, 1 - beta1, beta2, 1 - beta2, eps, step size, 1/sqrt(bc2)


def hyperparameters(dtype, step, lr, beta1, beta2, eps, weight_decay, frozen_at=0):
    """The update's eight scalars for step ``step`` (from 1), computed in float64 and rounded once to
    ``dtype``: a (HYPER,) array, the ``hyper`` of :func:`adamw_update`.

    ``frozen_at`` > 0 freezes the second moment: v = 1 * v + 0 * g^2 leaves it as it was (bit
    for bit, for finite g) and its bias correction is that of step ``frozen_at``.
    """
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** (frozen_at or step)
    b2 = 1.0 if frozen_at else beta2
    return np.array([1.0 - lr * weight_decay, beta1, 1.0 - beta1, b2, 1.0 - b2, eps, lr / bias_correction1,
                     1.0 / math.sqrt(bias_correction2)]).astype(dtype)


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True, nogil=True)
def _adamw_step(p, g, m, v, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, inv_sqrt_bc2,
                velocity):
    for i in range(p.size):
        p[i], m[i], v[i] = _update_cpu(p[i], g[i], m[i], v[i], decay, beta1, one_minus_beta1, beta2,
                                       one_minus_beta2, eps, step_size, inv_sqrt_bc2, velocity)


def adamw_update(params, grads, exp_avg, exp_avg_sq, hyper, velocity=False):
    """One AdamW update of the flat ``params`` (P,) with the scalars ``hyper`` (:func:`hyperparameters`);
    with ``velocity`` ``grads`` are summed velocities (module doc). Split over the CPU threads."""
    cpu_threads.for_rows(lambda lo, hi: _adamw_step(params[lo:hi], grads[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi],
                                                    *hyper, bool(velocity)), params.size, params.size, ns_per_element=2.5)


def adamw_step(params, grads, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, frozen_at=0,
               velocity=False):
    """:func:`adamw_update` at step ``step`` (from 1), learning rate ``lr`` and the rest as
    :func:`hyperparameters` takes them."""
    adamw_update(params, grads, exp_avg, exp_avg_sq,
                 hyperparameters(params.dtype, step, lr, beta1, beta2, eps, weight_decay, frozen_at), velocity)


# ---- launcher ----------------------------------------------------------------------
def adamw_update_cuda(params, grads, exp_avg, exp_avg_sq, hyper, velocity=False, *, stream=0):
    """:func:`adamw_update` on the GPU; ``hyper`` is a device array."""
    launch = configured_elementwise(kernels.adamw_update_kernel(_update), params.size, stream)
    launch(params, grads, exp_avg, exp_avg_sq, hyper, bool(velocity))
