"""SGD with momentum (PyTorch semantics) over flat buffers of P elements.

d = g + wd * p;  v = mu * v + d;  p -= lr * (d + mu * v if nesterov else v)
With mu = 0 the momentum buffer is untouched and the step is p -= lr * d.
The per-element update is one plain function compiled for both targets. Its
scalars arrive in the parameters' dtype, so float32 buffers are updated in
float32 arithmetic (a float64 scalar would promote every product to float64).

The op (``sgd_update``) reads lr, mu and wd from an array (``hyper``, :func:`hyperparameters`): on
a GPU it lives in device memory, refilled once per step by an upload, so a step's launches are
the same every step and a CUDA graph can replay them (training/cuda_graphs.py).
"""

import numpy as np
from numba import njit

from .support import cpu_threads
from .support.cuda_support import configured_elementwise
from .support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.sgd_cuda")  # the CUDA kernels launched here (imported at the first launch)


def _update(p, g, v, lr, momentum, weight_decay, nesterov):
    """One element: returns the new (p, v)."""
    d = g + weight_decay * p
    if momentum != 0.0:
        v = momentum * v + d
        d = d + momentum * v if nesterov else v
    return p - lr * d, v


_update_cpu = njit(_update)   # the GPU's compile of it: sgd_cuda.sgd_update_kernel


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True, nogil=True)
def _sgd_step(p, g, v, lr, momentum, weight_decay, nesterov):
    for i in range(p.size):
        p[i], v[i] = _update_cpu(p[i], g[i], v[i], lr, momentum, weight_decay, nesterov)


def hyperparameters(dtype, lr, momentum, weight_decay):
    """(lr, momentum, weight_decay) as a (3,) array of ``dtype``: the ``hyper`` of :func:`sgd_update`."""
    return np.array([lr, momentum, weight_decay]).astype(dtype)


def sgd_update(params, grads, momentum_buf, hyper, nesterov):
    """Update the flat ``params`` (P,) in place from ``grads`` (P,); ``momentum_buf`` (P,) is state.
    Split over the CPU threads."""
    cpu_threads.for_rows(lambda lo, hi: _sgd_step(params[lo:hi], grads[lo:hi], momentum_buf[lo:hi], hyper[0], hyper[1],
                                                  hyper[2], bool(nesterov)), params.size, params.size, ns_per_element=1.0)


def sgd_step(params, grads, momentum_buf, lr, momentum, weight_decay, nesterov):
    """:func:`sgd_update` with the three scalars given one by one."""
    sgd_update(params, grads, momentum_buf, hyperparameters(params.dtype, lr, momentum, weight_decay), nesterov)


# ---- launcher ----------------------------------------------------------------------
def sgd_update_cuda(params, grads, momentum_buf, hyper, nesterov, *, stream=0):
    """:func:`sgd_update` on the GPU; ``hyper`` is a device array."""
    launch = configured_elementwise(kernels.sgd_update_kernel(_update), params.size, stream)
    launch(params, grads, momentum_buf, hyper, bool(nesterov))
