"""Compute kernels: every op is an ``<op>_forward`` / ``<op>_backward`` pair (or one update) with a
CPU twin and CUDA kernels, in one layout.

  <op>.py        the contract (its docstring: shapes, dtypes, who calls it), the CPU twin - NumPy
                 (BLAS GEMM) or a ``numba.njit`` loop, the reference the tests check against NumPy
                 and finite differences - and the launchers, which pick grid and block and take the
                 device's ``stream`` (and, where a kernel needs reusable scratch, ``scratch``);
  <op>_cuda.py   the op's CUDA kernels (``numba.cuda.jit``, named ``..._kernel``), which also run
                 under the numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1) at small sizes. It never
                 imports <op>.py (which imports it as ``kernels``): a kernel that runs an element
                 function shared with the twin is made by a cached factory that is handed it;
  <op>/          a large op's folder of such pairs (attention/: the twin, the flash kernels, the
                 GEMM path and the choice between them);
  support/       what the ops share: launch geometry and the simulator switch (cuda_support), the
                 CPU twins' threads (cpu_threads) and exp (cpu_exp), cuBLAS through CuPy (cublas)
                 and strided-batched GEMMs (batched_gemm).

Names: ``<op>_forward`` (or ``sgd_update``, ``scale``, ...) is the CPU twin; the same name with
``_cuda`` is its numba launcher; ``_cuda_<variant>`` an alternative GPU path of the same contract
(``linear_forward_cuda_cublas``, ``attention_forward_cuda_gemm``). A device
(:mod:`hpctrain.device`, its table in ``device/ops.py``) maps op names to the implementation it
runs, so layers never ask which device they are on.
Where the math is elementwise, it is one plain Python function compiled for both targets (the
activations in :mod:`.bias_act`, the optimizer updates), so the twin and the kernel cannot drift
apart.

CPU twins that loop in numba are compiled ``nogil=True`` so the gradient communication thread can
call MPI while the main thread computes.

Shape legend: B = batch rows on this rank, I = input features, O = output
features, C = classes (softmax_xent), P = parameters in a flat buffer.
GPT ops (embedding, layernorm, attention, residual, llm.c's names): T =
positions in a sequence (T <= the context, Tmax), C = d_model channels,
NH = attention heads, hs = C / NH head size, V = vocabulary, N = B * T rows
(layernorm sees the (B, T, C) activations as (N, C)).
Backward functions either overwrite or accumulate into gradient views of the
flat gradient buffer (``accumulate=True`` for gradient accumulation).
"""
