"""The attention kernels (hpctrain/kernels/attention/: flash_cuda.py, gemm_cuda.py) for tests/ptx_compile.py.

Every variant a launch can pick: for each dtype and head-size capacity, each
tile from 4 up to the largest whose shared memory fits (a forced tile must fit
too). The accumulators of the three tiled kernels must stay in registers.
"""

from numba.types import Array, float32, float64, int64

from hpctrain.kernels.attention import flash, flash_cuda, gemm_cuda


def kernels():
    """(name, kernel, argument types, must the PTX be free of local memory)."""
    for dt in (float32, float64):
        a3 = Array(dt, 3, "C")
        for hs_max in flash.HS_SIZES:
            for tile in flash.TILES:
                fwd, dkv, dq = flash_cuda.attention_kernels(dt.name, tile, hs_max)
                for kind, kernel, sig in (("forward", fwd, (a3, int64, dt, a3, a3)),
                                          ("backward_dkv", dkv, (a3, a3, a3, a3, int64, dt, a3)),
                                          ("backward_dq", dq, (a3, a3, a3, a3, int64, dt, a3))):
                    if flash._smem_bytes(kind, tile, hs_max, dt.bitwidth // 8) <= flash.SMEM_LIMIT:
                        yield f"attention {kind} tile={tile} hs<={hs_max} {dt}", kernel, sig, True
        yield f"attention dsum {dt}", flash_cuda.dsum_kernel(dt.name), (a3, a3, int64, a3), False
        # the GEMM path's softmax kernels (model.attention = gemm), at the GPU's block size
        rows, probs, grad = gemm_cuda.row_kernels(dt.name, 128)
        scores = (a3, dt, Array(dt, 2, "A"), int64)   # the lse: a chunk's strided (n, T) view
        yield f"attention gemm softmax_rows {dt}", rows, scores, False
        yield f"attention gemm probs {dt}", probs, scores, False
        yield f"attention gemm grad_rows {dt}", grad, (a3, a3, dt, int64), False
