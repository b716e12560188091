"""Gradient compressors with error feedback (docs/dist.md, "Gradient compression").

  base      the interface, error feedback, momentum correction, payload sizes
  quantize  fp16, bf16
  sparse    topk(ratio), randk(ratio)
  sign      1-bit sign with a scale per chunk
  powersgd  powersgd(rank, start_step)
  reducer   CompressedSum: a host bucket summed over ranks through a compressor
  device    DeviceCompressedSum: the same for a CUDA bucket, error feedback, encoding and
            decoding as kernels (hpctrain/kernels), only payloads on the host
  gradients GradientCompression: a run's gradient buckets summed through a compressor
            (dist.compress, dist.compress_scope); the bucket reducer calls it

:func:`make_compressor` builds one from its config text, e.g. ``"topk(0.01)"``.
:mod:`.gradients` applies it to the gradient buckets and picks the path: the device one for CUDA
buckets with scope "all" and no momentum correction, else the host one.
"""

from __future__ import annotations

import re

from .base import Compressor, Context, ErrorFeedback, NoCompression, payload_bytes
from .powersgd import PowerSGD
from .quantize import Bf16, Fp16
from .sign import Sign
from .sparse import RandK, TopK

_SPEC = re.compile(r"^\s*([a-z0-9]+)\s*(?:\(([^)]*)\))?\s*$")


def make_compressor(spec: str) -> Compressor:
    """'none' | 'fp16' | 'bf16' | 'topk(r)' | 'randk(r)' | 'sign' | 'powersgd(rank[, start_step])'."""
    m = _SPEC.match(spec or "none")
    if not m:
        raise ValueError(f"compressor {spec!r}: expected e.g. none, fp16, topk(0.01), powersgd(4, 10)")
    name, args = m.group(1), [a.strip() for a in (m.group(2) or "").split(",") if a.strip()]
    try:
        if name in ("none", "fp16", "bf16", "sign") and not args:
            return {"none": NoCompression, "fp16": Fp16, "bf16": Bf16, "sign": Sign}[name]()
        if name in ("topk", "randk") and len(args) == 1:
            return (TopK if name == "topk" else RandK)(float(args[0]))
        if name == "powersgd" and len(args) in (1, 2):
            return PowerSGD(*(int(a) for a in args))
    except ValueError as exc:
        raise ValueError(f"compressor {spec!r}: {exc}") from None
    raise ValueError(f"compressor {spec!r}: choose none, fp16, bf16, topk(ratio), randk(ratio), sign or "
                     f"powersgd(rank[, start_step])")


__all__ = ["Compressor", "Context", "ErrorFeedback", "NoCompression", "payload_bytes", "make_compressor",
           "Fp16", "Bf16", "TopK", "RandK", "Sign", "PowerSGD"]
