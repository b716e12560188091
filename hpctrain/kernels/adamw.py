"""AdamW (decoupled weight decay, PyTorch semantics) over flat buffers of P elements.

p *= 1 - lr * wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)     (t = step, from 1)
"""

import math

from numba import njit


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True)
def _adamw_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step_size, inv_sqrt_bc2):
    for i in range(p.size):
        p[i] *= 1.0 - lr * weight_decay
        m[i] = beta1 * m[i] + (1.0 - beta1) * g[i]
        v[i] = beta2 * v[i] + (1.0 - beta2) * g[i] * g[i]
        p[i] -= step_size * m[i] / (math.sqrt(v[i]) * inv_sqrt_bc2 + eps)


def adamw_step(params, grads, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """One AdamW update of the flat ``params`` (P,); ``step`` counts from 1."""
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    _adamw_step(params, grads, exp_avg, exp_avg_sq, float(lr), float(beta1), float(beta2), float(eps),
                float(weight_decay), lr / bias_correction1, 1.0 / math.sqrt(bias_correction2))
