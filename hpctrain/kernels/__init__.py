"""Compute kernels: every op is an ``<op>_forward`` / ``<op>_backward`` pair (or one update) with a
CPU twin and CUDA kernels, in one layout.

  <op>.py        the contract (shapes, dtypes, who calls it), the CPU twin (NumPy/BLAS or a
                 ``numba.njit(nogil=True)`` loop, so the communication thread can call MPI meanwhile;
                 the reference the tests check) and the launchers (grid, block, ``stream``, ``scratch``);
                 it reaches <op>_cuda.py and ``numba.cuda`` through ``support.lazy_import`` (imported at
                 the first launch: a run on the CPU, or auto where no driver loads, skips the ~0.6 s import)
  <op>_cuda.py   the CUDA kernels (``numba.cuda.jit``, ``..._kernel``; also run on the simulator). It
                 never imports <op>.py: an element function shared with the twin is handed to a
                 cached kernel factory, so the twin and the kernel cannot drift apart
  <op>/, support/  a large op's folder (attention/); what the ops share (geometry, threads, exp, GEMMs,
                 the column sums' device functions, the lazy import)

``<op>_forward`` (or ``sgd_update``, ``scale``, ...) is the CPU twin, ``<op>_forward_cuda`` its numba
launcher, ``_cuda_<variant>`` another GPU path of the same contract (``linear_forward_cuda_cublas``).
A device maps op names to what it runs (``device/ops.py``), so layers never ask which device they are
on. Backward functions overwrite or, with ``accumulate=True``, add into views of the flat gradients.

Shapes: B = batch rows on this rank, I / O = input / output features, C = classes (softmax_xent),
P = parameters in a flat buffer. GPT ops (llm.c's names): T = positions (T <= Tmax, the context),
C = d_model channels, NH = heads, hs = C / NH, V = vocabulary, N = B * T rows (layernorm sees the
(B, T, C) activations as (N, C)).
"""
