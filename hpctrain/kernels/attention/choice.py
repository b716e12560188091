"""Which attention path runs a call on a GPU (``model.attention``): the flash kernels (:mod:`.flash`)
or the batched GEMMs (:mod:`.gemm`), both keeping the same lse between forward and backward.

``auto`` (:func:`choose`) takes the GEMMs where cuBLAS is in use and T >= AUTO_GEMM_MIN_T, and
for head sizes the flash kernels do not compile (hs > 128); the flash kernels otherwise.
:class:`ChosenAttention` is what the CUDA device installs as its two attention ops.
"""

from __future__ import annotations

from .flash import HS_SIZES, attention_backward_cuda, attention_forward_cuda
from .gemm import attention_backward_cuda_gemm, attention_forward_cuda_gemm

# The flash kernels' per-tile loops cost per row ~T hs operations from shared memory (2.5
# TFLOP/s measured at T = 1024), the GEMM path ~T^2 memory traffic and three extra launches per
# chunk; from T = 256 the GEMMs' arithmetic is expected to win. An estimate from those two
# costs, not a measurement: benchmarks/kernels.py times both (attention flash vs gemm) on a GPU.
AUTO_GEMM_MIN_T = 256
MODES = ("auto", "flash", "gemm")


def choose(mode: str, T: int, hs: int, cublas: bool) -> str:
    """"flash" or "gemm" for ``model.attention = mode`` at sequence length T and head size hs;
    ``cublas``: whether the GEMMs run on cuBLAS (else the numba GEMM kernel or the simulator)."""
    if mode not in MODES:
        raise ValueError(f"model.attention={mode!r}: choose one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    if hs > HS_SIZES[-1]:
        return "gemm"
    return "gemm" if cublas and T >= AUTO_GEMM_MIN_T else "flash"


class ChosenAttention:
    """The device's attention ops for ``model.attention = mode``: per call, :func:`choose` picks
    the flash kernels or the GEMM path by the call's T and head size (both keep the same lse,
    so a model may take either at any shape). ``gemm``: the batched-GEMM executor, None where
    there is none (then only flash runs; the model's head-size check keeps hs within it)."""

    def __init__(self, mode: str, stream, scratch, gemm=None):
        choose(mode, 1, 1, False)  # a bad mode fails here, at start-up
        self.mode, self.stream, self.scratch, self.gemm = mode, stream, scratch, gemm

    def which(self, T: int, hs: int) -> str:
        """"flash" or "gemm" at sequence length T and head size hs."""
        if self.gemm is None:
            return "flash"
        return choose(self.mode, T, hs, self.gemm.name == "cublas")

    def _gemm(self, qkv, n_head) -> bool:
        return self.which(qkv.shape[1], qkv.shape[2] // 3 // max(1, n_head)) == "gemm"

    def forward(self, qkv, n_head, out, lse):
        if self._gemm(qkv, n_head):
            return attention_forward_cuda_gemm(qkv, n_head, out, lse, stream=self.stream, scratch=self.scratch,
                                               gemm=self.gemm)
        return attention_forward_cuda(qkv, n_head, out, lse, stream=self.stream)

    def backward(self, dout, qkv, out, lse, n_head, dqkv, work):
        if self._gemm(qkv, n_head):
            return attention_backward_cuda_gemm(dout, qkv, out, lse, n_head, dqkv, work, stream=self.stream,
                                                scratch=self.scratch, gemm=self.gemm)
        return attention_backward_cuda(dout, qkv, out, lse, n_head, dqkv, work, stream=self.stream)
