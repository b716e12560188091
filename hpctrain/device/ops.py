"""The op table, written once: for every op its CPU twin, its CUDA launcher and what it writes.

Layers call ``device.ops.<op>`` and never ask which device they are on. :func:`cpu_ops` and
:func:`cuda_ops` make the two devices' tables from :data:`OPS`, so both always offer the same ops
with the same signatures. An op's twin is ``kernels/<op>.py``'s ``<name>``, its launcher the same
module's ``<name>_cuda`` (hpctrain/kernels/__init__.py). The GEMM and attention ops' CUDA
launchers are chosen at run time (``train.gemm``: :data:`CUBLAS_GEMMS`; ``model.attention``:
:class:`~hpctrain.kernels.attention.ChosenAttention`; :class:`~hpctrain.device.cuda.CudaDevice`
installs them); their rows name the numba launchers that stand when nothing else is chosen.

``writes`` says which arguments an op writes (by parameter name; "a|b": the CPU twin's name, then
the CUDA launcher's; "x?flag": x is also read when argument ``flag`` is true, as an accumulation):
under a 16-bit ``train.precision`` the :class:`~hpctrain.device.mixed.MixedDevice` rounds those
back after the float32 kernel ran and widens them first only when they are read. ``None``: the op
works on the master dtype's flat buffers (the optimizer, the gradient's checks) or is a conversion
itself, and is used as it is.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

from ..kernels import (adamw, attention, bias_act, ef, embedding, finite, lamb, layernorm, linear, lowp, residual,
                       scale, sgd, softmax_xent, sum_squares)


@dataclass(frozen=True)
class Op:
    """One op: its CPU twin, its CUDA launcher (keyword ``stream``; ``scratch`` too where
    ``scratch``), and the arguments it writes (module docstring)."""

    cpu: object
    cuda: object
    writes: tuple | None
    scratch: bool = False


OPS = {
    # the GEMMs (CUDA: numba's kernels, or cuBLAS under train.gemm)
    "linear_forward": Op(linear.linear_forward, linear.linear_forward_cuda, ("z",)),
    "linear_backward": Op(linear.linear_backward, linear.linear_backward_cuda, ("dx",)),
    "tied_head_forward": Op(linear.tied_head_forward, linear.tied_head_forward_cuda, ("logits",)),
    "tied_head_backward": Op(linear.tied_head_backward, linear.tied_head_backward_cuda, ("dx",)),
    "bias_act_forward": Op(bias_act.bias_act_forward, bias_act.bias_act_forward_cuda, ("out",)),
    "bias_act_backward": Op(bias_act.bias_act_backward, bias_act.bias_act_backward_cuda, ("dz",), True),
    "softmax_xent_forward": Op(softmax_xent.softmax_xent_forward, softmax_xent.softmax_xent_forward_cuda,
                               ("probs",), True),
    "softmax_xent_backward": Op(softmax_xent.softmax_xent_backward, softmax_xent.softmax_xent_backward_cuda,
                                ("dlogits",)),
    "softmax_xent_fused": Op(softmax_xent.softmax_xent_fused, softmax_xent.softmax_xent_fused_cuda,
                             ("dlogits",), True),
    "softmax_xent_fused_add": Op(softmax_xent.softmax_xent_fused_add, softmax_xent.softmax_xent_fused_add_cuda,
                                 ("dlogits",), True),
    # the optimizers and the gradient's checks: master-dtype flat buffers
    "sgd_update": Op(sgd.sgd_update, sgd.sgd_update_cuda, None),
    "adamw_update": Op(adamw.adamw_update, adamw.adamw_update_cuda, None),
    "lamb_direction": Op(lamb.lamb_direction, lamb.lamb_direction_cuda, None),
    "scale": Op(scale.scale, scale.scale_cuda, None),
    "all_finite": Op(finite.all_finite, finite.all_finite_cuda, None, True),
    "sum_squares": Op(sum_squares.sum_squares, sum_squares.sum_squares_cuda, None, True),
    "sum_squares_each": Op(sum_squares.sum_squares_each, sum_squares.sum_squares_each_cuda, None, True),
    "narrow": Op(lowp.narrow, lowp.narrow_cuda, None),
    "widen": Op(lowp.widen, lowp.widen_cuda, None),
    "fill": Op(ef.fill, ef.fill_cuda, None),
    # the GPT's ops (CUDA attention: the flash kernels or batched GEMMs, under model.attention)
    "embedding_forward": Op(embedding.embedding_forward, embedding.embedding_forward_cuda, ("out",)),
    "embedding_backward": Op(embedding.embedding_backward, embedding.embedding_backward_cuda, (), True),
    "layernorm_forward": Op(layernorm.layernorm_forward, layernorm.layernorm_forward_cuda,
                            ("out", "mean", "rstd")),
    "residual_layernorm_forward": Op(layernorm.residual_layernorm_forward,
                                     layernorm.residual_layernorm_forward_cuda, ("x", "out", "mean", "rstd")),
    "layernorm_backward": Op(layernorm.layernorm_backward, layernorm.layernorm_backward_cuda,
                             ("dx?add_dx",), True),
    "attention_forward": Op(attention.attention_forward, attention.attention_forward_cuda, ("out", "probs|lse")),
    "attention_backward": Op(attention.attention_backward, attention.attention_backward_cuda,
                             ("dqkv", "work")),
    "residual_forward": Op(residual.residual_forward, residual.residual_forward_cuda, ("out",)),
    "residual_backward": Op(residual.residual_backward, residual.residual_backward_cuda,
                            ("da?accumulate", "db?accumulate")),
}

GEMM_OPS = ("linear_forward", "linear_backward", "tied_head_forward", "tied_head_backward")
# their cuBLAS launchers (train.gemm = cublas), which the CUDA device installs in place of the numba ones
CUBLAS_GEMMS = {name: getattr(linear, f"{name}_cuda_cublas") for name in GEMM_OPS}
# what a table also says of its device's attention (not ops: no rounding applies to them)
FACTS = ("attention_state_shapes", "attention_saved_kind", "attention_max_head_size")


def cpu_ops() -> SimpleNamespace:
    """The CPU device's table: the twins themselves, and what the attention keeps for backward."""
    return SimpleNamespace(
        **{name: op.cpu for name, op in OPS.items()},
        attention_state_shapes=attention.attention_state_shapes,
        attention_saved_kind="probabilities",   # what the saved state is (a 16-bit compute dtype keeps it so)
        attention_max_head_size=None,           # the twin takes any head size
    )


def cuda_ops(stream, scratch) -> SimpleNamespace:
    """A GPU's table: every launcher on ``stream`` (and ``scratch``, the device's lender of work
    arrays, where it takes one). The GEMMs and the attention are then installed by the device."""
    def bound(op):
        return functools.partial(op.cuda, stream=stream, **({"scratch": scratch} if op.scratch else {}))

    return SimpleNamespace(
        **{name: bound(op) for name, op in OPS.items()},
        attention_state_shapes=attention.attention_state_shapes_cuda,
        attention_saved_kind="lse",   # one log-sum-exp per row: kept in float32 under a 16-bit compute dtype
        attention_max_head_size=attention.HS_SIZES[-1],
    )
