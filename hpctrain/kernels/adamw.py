"""AdamW (decoupled weight decay, PyTorch semantics) over flat buffers of P elements.

p *= 1 - lr * wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)     (t = step, from 1)
The per-element update is one plain function compiled for both targets; the
bias corrections are computed once per step on the host.
"""

import math

from numba import cuda, njit

from .cuda_support import THREADS, blocks_for


def _update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step_size, inv_sqrt_bc2):
    """One element: returns the new (p, m, v)."""
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    return p - step_size * m / (math.sqrt(v) * inv_sqrt_bc2 + eps), m, v


_update_cpu = njit(_update)
_update_gpu = cuda.jit(device=True)(_update)


def _scalars(step, lr, beta1, beta2, eps, weight_decay):
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    return (float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
            lr / bias_correction1, 1.0 / math.sqrt(bias_correction2))


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True, nogil=True)
def _adamw_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step_size, inv_sqrt_bc2):
    for i in range(p.size):
        p[i], m[i], v[i] = _update_cpu(p[i], g[i], m[i], v[i], lr, beta1, beta2, eps, weight_decay,
                                       step_size, inv_sqrt_bc2)


def adamw_step(params, grads, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """One AdamW update of the flat ``params`` (P,); ``step`` counts from 1."""
    _adamw_step(params, grads, exp_avg, exp_avg_sq, *_scalars(step, lr, beta1, beta2, eps, weight_decay))


# ---- CUDA kernel -------------------------------------------------------------------
@cuda.jit
def _adamw_step_kernel(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step_size, inv_sqrt_bc2):
    i = cuda.grid(1)
    while i < p.size:
        p[i], m[i], v[i] = _update_gpu(p[i], g[i], m[i], v[i], lr, beta1, beta2, eps, weight_decay,
                                       step_size, inv_sqrt_bc2)
        i += cuda.gridsize(1)


# ---- launcher ----------------------------------------------------------------------
def adamw_step_cuda(params, grads, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, *, stream=0):
    _adamw_step_kernel[blocks_for(params.size), THREADS, stream](
        params, grads, exp_avg, exp_avg_sq, *_scalars(step, lr, beta1, beta2, eps, weight_decay))
