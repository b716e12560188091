"""The GPT ops' CUDA kernels (embedding, layernorm, residual) for the PTX
compile check: ``kernels()`` yields them as tests/ptx_compile.py's does.

Import tests/ptx_compile.py first (it answers numba's compute-capability
question for device functions). Run alone, this compiles and assembles them:
    NUMBA_ENABLE_CUDASIM=0 PYTHONPATH=.:tests python tests/ptx_gpt_ops.py
"""

import sys

import ptx_compile  # noqa: F401 - first: patches numba's get_current_device
from numba.types import Array, boolean, float32, float64, int32, int64

from hpctrain.kernels import embedding_cuda, layernorm_cuda, residual_cuda


def arr(dtype, ndim):
    return Array(dtype, ndim, "C")


def kernels():
    """(name, kernel, argument types, must the PTX be free of local memory)."""
    i32, tokens = arr(int32, 1), arr(int64, 2)
    f64m = arr(float64, 2)
    for dt in (float32, float64):
        v, m, t3 = arr(dt, 1), arr(dt, 2), arr(dt, 3)
        yield f"embedding forward {dt}", embedding_cuda.embedding_forward_kernel, (tokens, m, m, t3), False
        yield f"embedding dwpe {dt}", embedding_cuda.dwpe_kernel, (t3, m, boolean), False
        yield f"embedding dwte {dt}", embedding_cuda.dwte_kernel, (m, i32, i32, m), False  # dout as (B T, C)
        yield f"layernorm forward {dt}", layernorm_cuda.layernorm_forward_kernel, (m, m, m, v, v, m, v, v, float64), \
            False
        yield f"layernorm forward with the residual add {dt}", layernorm_cuda.residual_layernorm_forward_kernel, \
            (m, m, m, v, v, m, v, v, float64), False
        yield f"layernorm param grads {dt}", layernorm_cuda.layernorm_param_grads_kernel, \
            (m, m, v, v, f64m, f64m, i32, v, v, boolean), False
        yield f"layernorm dx {dt}", layernorm_cuda.layernorm_dx_kernel, (m, m, v, v, v, m, boolean), False
        yield f"residual forward {dt}", residual_cuda.residual_forward_kernel, (v, v, v), False
        yield f"residual copy_or_add {dt}", residual_cuda.copy_or_add_kernel, (v, v, boolean), False
        yield f"residual backward {dt}", residual_cuda.residual_backward_kernel, (v, v, v, boolean), False
    # the dwte bucketing: integers only
    yield "embedding zero counts", embedding_cuda.zero_counts_kernel, (i32,), False
    yield "embedding count tokens", embedding_cuda.count_tokens_kernel, (tokens, i32), False
    yield "embedding bucket offsets", embedding_cuda.bucket_offsets_kernel, (i32, i32), False
    yield "embedding place positions", embedding_cuda.place_positions_kernel, (tokens, i32, i32, i32), False
    yield "embedding sort buckets", embedding_cuda.sort_buckets_kernel, (tokens, i32, i32, i32), False


if __name__ == "__main__":
    ptx_compile.kernels = kernels  # reuse its compile-assemble-report loop on these kernels
    sys.exit(ptx_compile.main())
