"""Compile every CUDA kernel to PTX for a real GPU, without one (run by
test_cuda_compile.py in a fresh process with NUMBA_ENABLE_CUDASIM=0).

The simulator runs kernels as Python, so it accepts code numba's CUDA compiler
rejects (a shared-array shape that is not a compile-time constant, say). NVVM
from pip (numba-cuda[cu12]) compiles without a driver; only device functions
ask the driver for the current GPU's compute capability, so that question is
answered here with the target's.

Prints one line per kernel; exit status 1 if any failed.
"""

import sys
import types as pytypes

import numba.cuda.dispatcher as dispatcher
from numba import cuda
from numba.types import Array, boolean, float32, float64, int64

CC = (9, 0)  # sm_90: H100 / H200
dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=CC)

from hpctrain.kernels import adamw, bias_act, linear, scale, sgd, softmax_xent  # noqa: E402


def arr(dtype, ndim):
    return Array(dtype, ndim, "C")


def kernels():
    """(name, kernel, argument types, must the PTX be free of local memory)."""
    for dt in (float32, float64):
        m, v = arr(dt, 2), arr(dt, 1)
        for ta in (False, True):
            for tb in (False, True):
                # the 4 x 4 accumulators must live in registers, not local memory
                yield f"gemm TA={ta:d} TB={tb:d} {dt}", linear._gemm_kernel(ta, tb, dt.name), (m, m, m, boolean), True
        for act, (fwd, bwd) in bias_act._CUDA.items():
            yield f"bias_act forward {act} {dt}", fwd, (m, v, m), False
            yield f"bias_act backward {act} {dt}", bwd, (m, m, m, arr(float64, 2)), False
        f64 = arr(float64, 1)
        yield f"softmax_xent rows {dt}", softmax_xent._softmax_xent_rows_kernel, (m, arr(int64, 1), m, f64, f64), False
        yield f"softmax_xent backward {dt}", softmax_xent._softmax_xent_backward_kernel, \
            (m, arr(int64, 1), float64, m), False
        yield f"sgd {dt}", sgd._sgd_step_kernel, (v, v, v, float64, float64, float64, boolean), False
        yield f"adamw {dt}", adamw._adamw_step_kernel, (v,) * 4 + (float64,) * 7, False
        yield f"scale {dt}", scale._scale_kernel, (v, dt), False
        yield f"bias partial sums -> {dt}", bias_act._sum_partials, (arr(float64, 2), v, boolean), False
    yield "softmax_xent row sums", softmax_xent._sum_rows_kernel, (arr(float64, 1),) * 3, False


def main() -> int:
    failed = 0
    for name, kernel, sig, registers_only in kernels():
        try:
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=CC)
        except Exception as exc:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:600]}")
            continue
        if registers_only and ".local" in ptx:
            failed += 1
            print(f"FAIL {name}: uses local memory (accumulators spilled out of registers)")
            continue
        print(f"ok   {name}: {ptx.count(chr(10))} PTX lines")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
