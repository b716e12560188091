"""Sparse payloads (top-k, random-k): take k entries with their error feedback, and scatter them back.

  sparse_take     r (n,) float32 corrected gradient, idx (k,) int32 distinct:
                  values[j] = r[idx[j]];  r[idx[j]] -= values[j]
                  r becomes the residual: corrected - decode(payload), which is
                  r itself off the indices and r - r (0, or NaN for inf/NaN) on them
  sparse_scatter  out[idx[j]] = values[j], or += with ``accumulate`` (decode of one
                  rank's payload; idx distinct, so no two threads touch one element)

The host compressors decode by scattering into zeros and subtracting/adding the
whole vector; the entries off the indices then get x - 0 and x + 0, which leave
x as it is (x + 0 could only change a -0.0, and a sum started from +0.0 never
is one), so the sparse forms here give the same bits.
"""


from .support.cuda_support import configured_elementwise
from .support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.gather_scatter_cuda")  # the CUDA kernels launched here (imported at the first launch)


# ---- CPU twins (NumPy) -------------------------------------------------------------
def sparse_take(r, idx, values):
    values[:] = r[idx]
    r[idx] -= values
    return values


def sparse_scatter(out, idx, values, accumulate=False):
    if accumulate:
        out[idx] += values
    else:
        out[idx] = values
    return out


# ---- launchers ---------------------------------------------------------------------
def sparse_take_cuda(r, idx, values, *, stream=0):
    configured_elementwise(kernels.sparse_take_kernel, idx.size, stream)(r, idx, values)
    return values


def sparse_scatter_cuda(out, idx, values, accumulate=False, *, stream=0):
    configured_elementwise(kernels.sparse_scatter_kernel, idx.size, stream)(out, idx, values, bool(accumulate))
    return out
