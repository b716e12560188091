"""Compute kernels, one file per op, each an ``<op>_forward`` / ``<op>_backward`` pair.

Layout of every op file (the llm.c convention):
  1. the CPU twin: NumPy (BLAS GEMM) or a ``numba.njit`` loop - the reference
     the tests check against NumPy and finite differences;
  2. CUDA kernels (``numba.cuda.jit``), which also run under the numba CUDA
     simulator (NUMBA_ENABLE_CUDASIM=1) at small sizes;
  3. launchers (``<op>_cuda``) that pick grid and block and take the device's
     ``stream`` (and, where a kernel needs reusable scratch, ``scratch``).
Where the math is elementwise, it is one plain Python function compiled for
both targets (the activations in :mod:`.bias_act`, the optimizer updates), so the twin and the
kernel cannot drift apart.
A device (:mod:`hpctrain.device`) maps op names to the implementation it runs,
so layers never ask which device they are on.

CPU twins that loop in numba are compiled ``nogil=True`` so the gradient
communication thread can call MPI while the main thread computes.

Shape legend: B = batch rows on this rank, I = input features, O = output
features, C = classes (softmax_xent), P = parameters in a flat buffer.
GPT ops (embedding, layernorm, attention, residual, llm.c's names): T =
positions in a sequence (T <= the context, Tmax), C = d_model channels,
NH = attention heads, hs = C / NH head size, V = vocabulary, N = B * T rows
(layernorm sees the (B, T, C) activations as (N, C)).
Backward functions either overwrite or accumulate into gradient views of the
flat gradient buffer (``accumulate=True`` for gradient accumulation).
"""

