"""SGD with momentum (PyTorch semantics) over flat buffers of P elements.

d = g + wd * p;  v = mu * v + d;  p -= lr * (d + mu * v if nesterov else v)
With mu = 0 the momentum buffer is untouched and the step is p -= lr * d.
"""

from numba import njit


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True)
def _sgd_step(p, g, v, lr, momentum, weight_decay, nesterov):
    for i in range(p.size):
        d = g[i] + weight_decay * p[i]
        if momentum != 0.0:
            v[i] = momentum * v[i] + d
            d = d + momentum * v[i] if nesterov else v[i]
        p[i] -= lr * d


def sgd_step(params, grads, momentum_buf, lr, momentum, weight_decay, nesterov):
    """Update the flat ``params`` (P,) in place from ``grads`` (P,); ``momentum_buf`` (P,) is state."""
    _sgd_step(params, grads, momentum_buf, float(lr), float(momentum), float(weight_decay), bool(nesterov))
