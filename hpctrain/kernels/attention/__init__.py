"""Causal multi-head self-attention, one op in a folder: its CPU twin and two GPU paths.

  twin.py                  the CPU twin and the reference (NumPy's BLAS + numba): keeps P (B, NH, T, T)
  flash.py, flash_cuda.py  the flash-attention kernels (launchers, kernels): keep lse (B, NH, T)
  gemm.py, gemm_cuda.py    the same contract as batched GEMMs (cuBLAS, NumPy on the simulator)
                           around softmax-row kernels (``model.attention = gemm``)
  choice.py                which GPU path runs a call (``model.attention``): what the CUDA device installs

Names follow every op's scheme: ``attention_forward`` / ``attention_backward`` are the twin,
``..._cuda`` the flash launchers, ``..._cuda_gemm`` the GEMM path; ``attention_state_shapes``
(``_cuda``) says what each keeps between forward and backward.
"""

from .choice import ChosenAttention
from .flash import HS_SIZES, attention_backward_cuda, attention_forward_cuda, attention_state_shapes_cuda
from .gemm import attention_backward_cuda_gemm, attention_forward_cuda_gemm
from .twin import attention_backward, attention_forward, attention_state_shapes

__all__ = ["HS_SIZES", "ChosenAttention", "attention_backward", "attention_backward_cuda",
           "attention_backward_cuda_gemm", "attention_forward", "attention_forward_cuda",
           "attention_forward_cuda_gemm", "attention_state_shapes", "attention_state_shapes_cuda"]
