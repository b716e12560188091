"""Compute kernels, one file per op, each an ``<op>_forward`` / ``<op>_backward`` pair.

Layout of every op file (the llm.c convention):
  1. the CPU twin: NumPy (BLAS GEMM) or a ``numba.njit`` loop - the reference
     the tests check against NumPy and finite differences;
  2. CUDA kernels (``numba.cuda.jit``) - added by the cuda device (issue 3);
  3. launchers that pick grid and block for the CUDA kernels.
A device (:mod:`hpctrain.device`) maps op names to the implementation it runs,
so layers never ask which device they are on.

Shape legend: B = batch rows on this rank, I = input features, O = output
features, C = classes, P = parameters in a flat buffer.
Backward functions either overwrite or accumulate into gradient views of the
flat gradient buffer (``accumulate=True`` for gradient accumulation).
"""


def flat_views(*arrays):
    """1-D views of C-contiguous arrays, for elementwise kernels.

    A non-contiguous array would be silently copied by reshape and the kernel's
    output lost, so it is refused.
    """
    if not all(a.flags.c_contiguous for a in arrays):
        raise ValueError("elementwise kernels need C-contiguous arrays")
    return [a.reshape(-1) for a in arrays]
