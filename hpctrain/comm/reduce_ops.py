"""Reduction ops of the all-reduce strategies: names, MPI handles, compiled host kernels.

Ops are "sum", "mean", "max", "min"; "mean" reduces as the sum (:func:`reduce_kind`) and is then
scaled once by 1/size. :func:`sum_scaled` averages a gradient bucket (sum, one scale, optional
NaN/Inf test), in one pass where the strategy has its own. ``reduce_into(dst, src, op)`` is the
host reduction ring and rhd apply to each received chunk, compiled by numba.

NaN: a NaN on any rank makes the result NaN for every op (as ``numpy.maximum`` and IEEE 754-2019
``maximum`` do), on every rank alike. Open MPI's MAX/MIN are ``a > b ? a : b``, so whether its
result is NaN depends on the order in which ranks are combined.
"""

import numpy as np
from numba import njit

OPS = ("sum", "mean", "max", "min")


def reduce_kind(op: str) -> str:
    """The reduction that ``op`` performs over ranks ("mean" is a sum); ValueError if unknown."""
    if op not in OPS:
        raise ValueError(f"all-reduce op {op!r}: choose one of {', '.join(OPS)}")
    return "sum" if op == "mean" else op


def mpi_op(op: str):
    """The MPI handle for ``op`` (MPI.SUM for "mean"). Imports MPI on first use, never at import."""
    from mpi4py import MPI

    return {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[reduce_kind(op)]


def sum_scaled(strategy, buf, factor: float, device, check_finite: bool = False) -> bool:
    """``buf`` summed over ranks by ``strategy`` in place, then multiplied by ``factor`` rounded
    to its dtype (:mod:`hpctrain.kernels.scale`): a gradient bucket averaged over ranks and
    micro-batches. With ``check_finite``, returns False if this rank found a NaN or Inf in the
    result (always True without it). Strategies with a ``sum_scaled`` method of their own (shm,
    auto) give the same bits in one pass, and may test only this rank's share of the result (the
    ranks' answers together cover it: combine them over ranks); the others sum, scale and test
    the whole buffer. Collective."""
    own = getattr(strategy, "sum_scaled", None)
    if own is not None:
        return own(buf, factor, check_finite)
    strategy(buf, "sum")
    return scale_and_test(buf, factor, device, check_finite)


def scale_and_test(buf, factor: float, device, check_finite: bool) -> bool:
    """``buf *= factor`` (rounded to its dtype) on ``device`` unless it is 1; with ``check_finite``
    returns False if the whole buffer then holds a NaN or Inf (True otherwise). Local."""
    if factor != 1.0:
        device.ops.scale(buf, factor)
    return not check_finite or device.ops.all_finite(buf)


# ---- kernels (numba): plain loops the compiler vectorises --------------------------
@njit(cache=True, nogil=True)
def _sum_into(dst, src):
    for i in range(dst.size):
        dst[i] += src[i]


@njit(cache=True, nogil=True)
def _max_into(dst, src):
    for i in range(dst.size):
        # b != b is "b is NaN": a NaN in src wins; a NaN in dst stays (b > NaN is False)
        b = src[i]
        if b > dst[i] or b != b:
            dst[i] = b


@njit(cache=True, nogil=True)
def _min_into(dst, src):
    for i in range(dst.size):
        b = src[i]
        if b < dst[i] or b != b:
            dst[i] = b


_KERNELS = {"sum": _sum_into, "max": _max_into, "min": _min_into}


def reduce_into(dst, src, op: str):
    """``dst = dst <op> src`` in place; returns ``dst``.

    dst, src: 1-D C-contiguous host arrays (NumPy or pinned), the same length and
    the same dtype, float32 or float64. ``op`` is any of :data:`OPS` ("mean"
    reduces as "sum"). Called by the ring and rhd strategies on every rank.
    """
    kind = reduce_kind(op)
    if dst.ndim != 1 or src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"reduce_into: dst {dst.dtype}{dst.shape} and src {src.dtype}{src.shape} "
                         f"must be 1-D arrays of one shape and dtype")
    if dst.dtype not in (np.float32, np.float64):
        raise ValueError(f"reduce_into: dtype {dst.dtype} unsupported; use float32 or float64")
    if not (dst.flags.c_contiguous and src.flags.c_contiguous):
        raise ValueError("reduce_into: dst and src must be contiguous")
    if dst.size:
        _KERNELS[kind](dst, src)
    return dst
