"""Elementwise steps of error feedback on flat vectors (the device path of hpctrain/compress).

  ef_correct        r <- float32(x) + r           x (n,) float32|float64, r (n,) float32: r now holds
                                                   the corrected gradient the compressor encodes
  lowrank_residual  m <- m - a / float32(size)    PowerSGD: m (n,) holds M_i, a the summed
                                                   approximation; m becomes the residual
  cast_copy         dst <- src                    between float32 and the bucket's dtype
  fill              dst <- value

Each is the same float32 operation as the host compressors' NumPy (one rounding
per element), so both give the same bits. Launchers take arrays of any shape
with a contiguous layout and flatten them (views, no copies).
"""

import numpy as np

from .support.cuda_support import configured_elementwise
from .support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.ef_cuda")  # the CUDA kernels launched here (imported at the first launch)


# ---- CPU twins (NumPy) -------------------------------------------------------------
def ef_correct(x, r):
    r += np.asarray(x, np.float32).reshape(r.shape)
    return r


def lowrank_residual(m, a, size):
    np.subtract(m, a / np.float32(size), out=m)
    return m


def cast_copy(src, dst):
    dst[...] = src
    return dst


def fill(dst, value):
    dst[...] = value
    return dst


# ---- launchers ---------------------------------------------------------------------
def _flat(a):
    return a.reshape(a.size)


def ef_correct_cuda(x, r, *, stream=0):
    configured_elementwise(kernels.ef_correct_kernel, r.size, stream)(_flat(x), _flat(r))
    return r


def lowrank_residual_cuda(m, a, size, *, stream=0):
    launch = configured_elementwise(kernels.lowrank_residual_kernel, m.size, stream)
    launch(_flat(m), _flat(a), np.float32(size))
    return m


def cast_copy_cuda(src, dst, *, stream=0):
    configured_elementwise(kernels.cast_copy_kernel, dst.size, stream)(_flat(src), _flat(dst))
    return dst


def fill_cuda(dst, value, *, stream=0):
    configured_elementwise(kernels.fill_kernel, dst.size, stream)(_flat(dst), np.dtype(dst.dtype).type(value))
    return dst
