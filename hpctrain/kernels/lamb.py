"""LAMB's update direction (You et al. 2019) over flat buffers of P elements, without applying it.

    m' = b1 m + (1-b1) g;   v' = b2 v + (1-b2) g^2
    r  = (m' / (1 - b1^t)) / (sqrt(v') / sqrt(1 - b2^t) + eps) + wd p

``lamb_direction`` writes r into ``out`` and leaves p, m and v as they are: LAMB scales each
parameter's step by a trust ratio, ||p|| / ||r||, which needs r's norm before any element moves.
The step itself is then AdamW's with the learning rate times that ratio (hpctrain/optim/elementwise.py):
AdamW's p (1 - lr wd) - lr m'/(...) is p - lr r, with the same m' and v' computed from the same m,
v and g. (AdamW folds lr / (1 - b1^t) into one factor, so its step may differ from lr r in the last
bit; only r's norm is taken from here.)

The scalars arrive as one array (``hyper``, :func:`hyperparameters`) in the parameters' dtype, as
AdamW's do: float32 buffers are computed in float32.
"""

import math

import numpy as np
from numba import njit

from .support import cpu_threads
from .support.cuda_support import configured_elementwise
from .support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.lamb_cuda")  # the CUDA kernels launched here (imported at the first launch)


def _direction(p, g, m, v, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, inv_bc1, inv_sqrt_bc2,
               weight_decay):
    """One element: r (module doc)."""
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    return m * inv_bc1 / (math.sqrt(v) * inv_sqrt_bc2 + eps) + weight_decay * p


_direction_cpu = njit(_direction)   # the GPU's compile of it: lamb_cuda.lamb_direction_kernel

HYPER = 8  # beta1, 1 - beta1, beta2, 1 - beta2, eps, 1 / (1 - beta1^t), 1 / sqrt(1 - beta2^t), weight decay


def hyperparameters(dtype, step, beta1, beta2, eps, weight_decay):
    """The direction's eight scalars at step ``step`` (from 1), computed in float64 and rounded once to
    ``dtype``: the ``hyper`` of :func:`lamb_direction`."""
    return np.array([beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, 1.0 / (1.0 - beta1 ** step),
                     1.0 / math.sqrt(1.0 - beta2 ** step), weight_decay]).astype(dtype)


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True, nogil=True)
def _lamb_direction(p, g, m, v, out, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, inv_bc1, inv_sqrt_bc2,
                    weight_decay):
    for i in range(p.size):
        out[i] = _direction_cpu(p[i], g[i], m[i], v[i], beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
                                inv_bc1, inv_sqrt_bc2, weight_decay)


def lamb_direction(params, grads, exp_avg, exp_avg_sq, hyper, out):
    """r of the flat ``params`` (P,) into ``out`` (P,), with the scalars ``hyper``; nothing else is
    written. Split over the CPU threads."""
    cpu_threads.for_rows(lambda lo, hi: _lamb_direction(params[lo:hi], grads[lo:hi], exp_avg[lo:hi],
                                                        exp_avg_sq[lo:hi], out[lo:hi], *hyper),
                         params.size, params.size, ns_per_element=2.5)
    return out


# ---- launcher ----------------------------------------------------------------------
def lamb_direction_cuda(params, grads, exp_avg, exp_avg_sq, hyper, out, *, stream=0):
    """:func:`lamb_direction` on the GPU; ``hyper`` is a device array."""
    launch = configured_elementwise(kernels.lamb_direction_kernel(_direction), params.size, stream)
    launch(params, grads, exp_avg, exp_avg_sq, out, hyper)
    return out
