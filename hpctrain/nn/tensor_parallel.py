"""Megatron-style tensor parallelism: the pieces a split layer needs.

A matrix split *by columns* (the QKV projection, the MLP's first Linear) gives each of the t
tensor ranks some of its outputs: forward needs no communication, and backward's input
gradient is a partial sum, all-reduced over the tensor group. A matrix split *by rows* (both
output projections) takes the matching slice of its input: forward's output is a partial sum,
all-reduced before the (replicated) bias is added once; backward needs no communication. So a
block costs one all-reduce of (N, C) in forward and one in backward per attention and per MLP.

Parameters keep their names; a split one holds the local piece (:func:`shard`) of its logical
array, which checkpoints store whole (each tensor rank writing its piece: :mod:`hpctrain.ckpt.boxes`),
so a checkpoint does not depend on t.
"""

from __future__ import annotations

import time
import zlib

import numpy as np

from .layers import Linear


class TensorGroup:
    """The tensor group's all-reduce for the layers: a sum in place over the t ranks, with our
    ``ring`` strategy (reduce-scatter then all-gather: every rank gets the same bits, so the
    replicated activations and parameters stay identical across the group). Counts what it
    moves: ``calls``, ``elements`` summed, ``bytes_sent`` per rank (ring: 2 (t - 1) / t of each
    buffer) and ``seconds`` (wall time of the calls, staging included)."""

    def __init__(self, world, device, staging):
        from ..comm.collectives import Collectives

        self.world, self.device = world, device
        self.rank, self.size = world.rank, world.size
        self._coll = Collectives(world, device, staging, allreduce="ring")
        self.calls = self.elements = self.bytes_sent = 0
        self.seconds = 0.0
        self._wide = {}  # elements -> a float32 array: a 16-bit buffer's sum is formed in float32

    def allreduce(self, buf):
        """``buf`` (a contiguous device array) <- its sum over the tensor group. A buffer in a 16-bit
        compute dtype (:mod:`hpctrain.precision`) is summed in the device's dtype, float32, and
        rounded once: every rank gets the same bits either way."""
        t0 = time.perf_counter()
        flat, low = buf.reshape(-1), buf.dtype != self.device.dtype
        if low:
            wide = self._wide.get(buf.size)
            if wide is None:
                wide = self._wide[buf.size] = self.device.empty((buf.size,))
            flat = self.device.ops.widen(flat, wide)
        self._coll.Allreduce(flat, "sum")
        if low:
            self.device.ops.narrow(flat, buf.reshape(-1))
        self.seconds += time.perf_counter() - t0
        n = buf.size
        self.calls += 1
        self.elements += n
        self.bytes_sent += 2 * (self.size - 1) * n * flat.dtype.itemsize // self.size
        return buf

    def take(self) -> dict:
        """The counts since the last call, as metrics fields, and zero them (the trainer takes
        them once per step)."""
        out = {"tensor_allreduces": self.calls, "tensor_bytes_sent": self.bytes_sent,
               "tensor_allreduce_time": self.seconds}
        self.calls = self.elements = self.bytes_sent = 0
        self.seconds = 0.0
        return out


class RowParallelLinear(Linear):
    """y = (x_r @ W_r summed over the tensor group) + b: W (I/t, O) is this rank's rows, x its
    matching columns of the input; the bias (O,) is replicated and added once, after the sum.
    Backward is :class:`Linear`'s: dout is the same on every rank, so dW_r = x_r^T dout and
    dx_r = dout W_r^T are already this rank's pieces, and db (a sum over rows of dout) is the
    same everywhere."""

    def __init__(self, device, name, n_in_local, n_out, group: TensorGroup):
        super().__init__(device, name, n_in_local, n_out)
        self.group = group

    def forward(self, x):
        ops = self.device.ops
        self.x = x
        self.z = ops.linear_forward(x, self.w, self._buffer("z", (x.shape[0], self.n_out)))
        self.group.allreduce(self.z)
        return ops.bias_act_forward(self.z, self.b, self.z, "identity")


def _index(length: int, parts: int, t: int, r: int) -> np.ndarray:
    """Positions along a split axis of ``length`` held by tensor rank ``r``: the axis is ``parts``
    equal blocks (QKV's q, k and v), each cut in t pieces; rank r holds piece r of every block."""
    block = length // parts
    piece = block // t
    return np.concatenate([np.arange(p * block + r * piece, p * block + (r + 1) * piece) for p in range(parts)])


def shard(full: np.ndarray, axis: int, parts: int, t: int, r: int) -> np.ndarray:
    """Tensor rank ``r``'s piece of the logical array ``full``."""
    return np.take(full, _index(full.shape[axis], parts, t, r), axis=axis)


def unshard(pieces: list, axis: int, parts: int) -> np.ndarray:
    """The logical array from every tensor rank's piece, in rank order (inverse of :func:`shard`)."""
    t = len(pieces)
    shape = list(pieces[0].shape)
    shape[axis] *= t
    full = np.empty(shape, pieces[0].dtype)
    for r, piece in enumerate(pieces):
        idx = [slice(None)] * len(shape)
        idx[axis] = _index(shape[axis], parts, t, r)
        full[tuple(idx)] = piece
    return full


class TensorLayout:
    """Which parameters a model splits, and their logical arrays.

    ``splits``: name -> (axis, parts) for each split parameter (the rest are replicated): what
    checkpoints map a rank's pieces by (:mod:`hpctrain.ckpt.boxes`). :meth:`logical` gathers a
    whole array (the tests' reference), collective over the tensor group (every rank, same names,
    same order).
    """

    def __init__(self, group: TensorGroup, splits: dict):
        self.group, self.splits = group, dict(splits)

    def logical_shape(self, name: str, shape: tuple) -> tuple:
        if name not in self.splits:
            return tuple(shape)
        axis, _ = self.splits[name]
        return tuple(d * self.group.size if i == axis else d for i, d in enumerate(shape))

    def logical(self, name: str, local: np.ndarray, drifted: list | None = None) -> np.ndarray:
        """The whole array of parameter ``name`` from this rank's ``local`` host array: gathered
        over the tensor group when split; when replicated, checked to be the same bits on every
        tensor rank (a difference is a bug that would train t different models): RuntimeError,
        or with ``drifted`` a line appended to it (the caller raises once every group has looked,
        so all ranks agree)."""
        comm = self.group.world.comm
        local = np.ascontiguousarray(local)
        if name not in self.splits:
            crcs = comm.allgather(zlib.crc32(local.view(np.uint8).reshape(-1)))
            if len(set(crcs)) > 1:
                why = (f"replicated parameter {name!r} differs across the tensor group (CRC32 per tensor rank: "
                       f"{', '.join(f'{c:08x}' for c in crcs)})")
                if drifted is None:
                    raise RuntimeError(why)
                drifted.append(why)
            return local
        pieces = np.empty((self.group.size,) + local.shape, local.dtype)
        comm.Allgather(local, pieces)
        axis, parts = self.splits[name]
        return unshard(list(pieces), axis, parts)

    def local(self, name: str, full: np.ndarray) -> np.ndarray:
        """This rank's piece of the logical array ``full`` (the whole of a replicated one)."""
        if name not in self.splits:
            return full
        axis, parts = self.splits[name]
        return shard(np.asarray(full), axis, parts, self.group.size, self.group.rank)
