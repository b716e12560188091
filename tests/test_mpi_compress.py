"""Compressed sums over ranks (run under mpirun -n 1..4): every rank ends with the same
bytes, the result is what the compressor promises, and error feedback loses nothing
over ranks and steps."""

import hashlib

import numpy as np
import pytest

from hpctrain.compress import Context, make_compressor
from hpctrain.compress.reducer import CompressedSum

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

SPECS = ["none", "fp16", "bf16", "topk(0.05)", "randk(0.1)", "sign", "powersgd(2)"]
SHAPES = [(40, 30), (30,), (30, 25)]  # a bucket of two layers' weights and a bias
N = sum(int(np.prod(s)) for s in SHAPES)


def _same_everywhere(comm, a):
    digests = comm.allgather(hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest())
    assert len(set(digests)) == 1


@pytest.mark.parametrize("spec", SPECS)
def test_compressed_sums_agree_and_error_feedback_keeps_the_total(spec):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    red = CompressedSum(comm, make_compressor(spec))
    sent_total = np.zeros(N)
    grad_total = np.zeros(N)
    for step in range(6):
        g = np.random.default_rng([step, comm.rank]).standard_normal(N).astype(np.float32)
        grad_total += comm.allreduce(g.astype(np.float64), op=MPI.SUM)
        out = red(g.copy(), Context(step, 0, seed=3), SHAPES)
        _same_everywhere(comm, out)
        sent_total += out
        assert red.dense_bytes == 2 * (comm.size - 1) * 4 * N // comm.size
        assert (red.sent_bytes < red.dense_bytes) or spec == "none" or comm.size == 1
    residual_total = comm.allreduce(_residual_vector(red), op=MPI.SUM)
    err = np.abs(sent_total + residual_total - grad_total).max()
    scale = np.abs(grad_total).max()
    # fp16/bf16: the ring's roundings of partial sums are outside error feedback (p - 1 hops
    # and the owner's final rounding per element and step, each <= 2^-11 (fp16) or 2^-8 (bf16)
    # of a partial sum, |partial| < 4 p here); everything else is exact to float32 rounding
    hop = {"fp16": 2.0**-11, "bf16": 2.0**-8}.get(spec, 0.0) if comm.size > 1 else 0.0
    bound = 1e-4 * scale + 6 * comm.size * hop * 4 * comm.size
    assert err <= bound, (spec, err, bound)


def _residual_vector(red):
    """This rank's residuals as one float64 vector of the bucket's layout (zeros where none)."""
    state = red.state()
    if red.c.combine != "lowrank":
        return state.get("residual/0", np.zeros(N, np.float32)).astype(np.float64)
    parts = []
    for layer, shape in enumerate(SHAPES):
        r = state.get(f"residual/0/{layer}")
        parts.append(np.zeros(int(np.prod(shape))) if r is None else r.reshape(-1).astype(np.float64))
    return np.concatenate(parts)


def test_uncompressed_equals_mpi_sum():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    g = np.random.default_rng(comm.rank).standard_normal(N).astype(np.float32)
    ref = g.copy()
    comm.Allreduce(MPI.IN_PLACE, ref, op=MPI.SUM)
    np.testing.assert_array_equal(CompressedSum(comm, make_compressor("none"))(g.copy(), Context(0, 0)), ref)


def test_bytes_sent_shrink_as_promised():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = 1 << 16
    g = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    sizes = {}
    for spec in ("topk(0.01)", "sign", "fp16"):
        red = CompressedSum(comm, make_compressor(spec))
        red(g.copy(), Context(0, 0))
        sizes[spec] = red.sent_bytes
    if comm.size > 1:
        dense = 2 * (comm.size - 1) / comm.size * 4 * n  # a ring all-reduce of float32, per rank
        assert sizes["fp16"] == pytest.approx(dense / 2, rel=0.01)
        # 656 kept: a float32 value and a 16-bit offset each, and one block count (n = 65536)
        assert sizes["topk(0.01)"] == (comm.size - 1) * (6 * 656 + 4)
        assert sizes["sign"] == (comm.size - 1) * (n // 8 + 4 * (n // 4096))
