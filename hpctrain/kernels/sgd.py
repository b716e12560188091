"""SGD with momentum (PyTorch semantics) over flat buffers of P elements.

d = g + wd * p;  v = mu * v + d;  p -= lr * (d + mu * v if nesterov else v)
With mu = 0 the momentum buffer is untouched and the step is p -= lr * d.
The per-element update is one plain function compiled for both targets. Its
scalars arrive in the parameters' dtype, so float32 buffers are updated in
float32 arithmetic (a float64 scalar would promote every product to float64).
"""

from numba import cuda, njit

from .cuda_support import THREADS, blocks_for


def _update(p, g, v, lr, momentum, weight_decay, nesterov):
    """One element: returns the new (p, v)."""
    d = g + weight_decay * p
    if momentum != 0.0:
        v = momentum * v + d
        d = d + momentum * v if nesterov else v
    return p - lr * d, v


_update_cpu = njit(_update)
_update_gpu = cuda.jit(device=True)(_update)


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True, nogil=True)
def _sgd_step(p, g, v, lr, momentum, weight_decay, nesterov):
    for i in range(p.size):
        p[i], v[i] = _update_cpu(p[i], g[i], v[i], lr, momentum, weight_decay, nesterov)


def sgd_step(params, grads, momentum_buf, lr, momentum, weight_decay, nesterov):
    """Update the flat ``params`` (P,) in place from ``grads`` (P,); ``momentum_buf`` (P,) is state."""
    t = params.dtype.type
    _sgd_step(params, grads, momentum_buf, t(lr), t(momentum), t(weight_decay), bool(nesterov))


# ---- CUDA kernel -------------------------------------------------------------------
@cuda.jit
def _sgd_step_kernel(p, g, v, lr, momentum, weight_decay, nesterov):
    i = cuda.grid(1)
    while i < p.size:
        p[i], v[i] = _update_gpu(p[i], g[i], v[i], lr, momentum, weight_decay, nesterov)
        i += cuda.gridsize(1)


# ---- launcher ----------------------------------------------------------------------
def sgd_step_cuda(params, grads, momentum_buf, lr, momentum, weight_decay, nesterov, *, stream=0):
    t = params.dtype.type
    _sgd_step_kernel[blocks_for(params.size), THREADS, stream](
        params, grads, momentum_buf, t(lr), t(momentum), t(weight_decay), bool(nesterov))
