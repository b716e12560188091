"""Strided-batched GEMMs (hpctrain/kernels/support/batched_gemm.py) without a GPU.

The row-major description is held to NumPy products of explicitly sliced matrices, and its
translation into cuBLAS's column-major arguments to an independent column-major reading
of the same memory: element (r, c) of a column-major matrix with leading dimension ld at
offset o is flat[o + r + c ld], and cuBLAS computes C = op(A) op(B) with op transposing when
its flag is OP_T. What is left untested here is only the call into cuBLAS itself.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hpctrain.kernels.support.batched_gemm import OP_T, GemmBatch, HostBatchedGemm, _check_span, cublas_arguments, host_gemm


def _case(trans_a, trans_b, seed=0):
    """A batch of 3 products (m, n, k) = (4, 5, 3) inside padded buffers: every matrix has a
    leading dimension wider than its rows and starts at an offset, the batches interleave."""
    r = np.random.default_rng([91, trans_a, trans_b, seed])
    m, n, k, batch = 4, 5, 3, 3
    (ra, ca), (rb, cb) = ((k, m) if trans_a else (m, k)), ((n, k) if trans_b else (k, n))
    # heads side by side, as attention's: batch i starts ca (cb, n) elements after batch i-1,
    # each row of every buffer padded past the last batch's columns
    lda, ldb, ldc = batch * ca + 7, batch * cb + 2, batch * n + 3
    g = GemmBatch(m, n, k, trans_a, trans_b, lda, ldb, ldc, off_a=5, off_b=2, off_c=1,
                  stride_a=ca, stride_b=cb, stride_c=n, batch=batch, alpha=1.0, beta=0.0)
    # each buffer ends where the last matrix does
    a = r.standard_normal(5 + (ra - 1) * lda + batch * ca)
    b = r.standard_normal(2 + (rb - 1) * ldb + batch * cb)
    c = r.standard_normal(1 + (m - 1) * ldc + batch * n)
    return g, a, b, c


def _expected(g, a, b, c):
    """C after the products, built matrix by matrix with explicit slices."""
    want = c.copy()
    (ra, ca), (rb, cb) = g.a_shape(), g.b_shape()
    for i in range(g.batch):
        A = np.stack([a[g.off_a + i * g.stride_a + r * g.lda:][:ca] for r in range(ra)])
        B = np.stack([b[g.off_b + i * g.stride_b + r * g.ldb:][:cb] for r in range(rb)])
        prod = g.alpha * ((A.T if g.trans_a else A) @ (B.T if g.trans_b else B))
        for r in range(g.m):
            s = slice(g.off_c + i * g.stride_c + r * g.ldc, g.off_c + i * g.stride_c + r * g.ldc + g.n)
            want[s] = prod[r] + g.beta * c[s]
    return want


def _column_major(args, buffers):
    """cublas<t>gemmStridedBatched's result, by its column-major definition, on flat arrays."""
    A_buf, A_off = buffers[args["A"][0]], args["A"][1]
    B_buf, B_off = buffers[args["B"][0]], args["B"][1]
    C = buffers[args["C"][0]].copy()
    m, n, k = args["m"], args["n"], args["k"]
    for i in range(args["batchCount"]):
        def get(buf, off, ld, stride, r, c):
            return buf[off + i * stride + r + c * ld]
        for row, col in itertools.product(range(m), range(n)):
            acc = 0.0
            for l in range(k):
                x = (get(A_buf, A_off, args["lda"], args["strideA"], l, row) if args["transa"] == OP_T else
                     get(A_buf, A_off, args["lda"], args["strideA"], row, l))
                y = (get(B_buf, B_off, args["ldb"], args["strideB"], col, l) if args["transb"] == OP_T else
                     get(B_buf, B_off, args["ldb"], args["strideB"], l, col))
                acc += x * y
            at = args["C"][1] + i * args["strideC"] + row + col * args["ldc"]
            C[at] = args["alpha"] * acc + args["beta"] * C[at]
    return C


@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product((False, True), repeat=2)))
def test_host_gemm_computes_each_product_of_the_batch_and_nothing_else(trans_a, trans_b):
    g, a, b, c = _case(trans_a, trans_b)
    want = _expected(g, a, b, c)
    host_gemm(g, a, b, c)
    np.testing.assert_allclose(c, want, rtol=1e-13, atol=1e-13)  # padding between rows left as it was


@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product((False, True), repeat=2)))
def test_cublas_arguments_compute_the_same_products_read_column_major(trans_a, trans_b):
    g, a, b, c = _case(trans_a, trans_b)
    for alpha, beta in ((1.0, 0.0), (0.5, 2.0)):
        g2 = GemmBatch(**{**g.__dict__, "alpha": alpha, "beta": beta})
        want = _expected(g2, a, b, c)
        got = _column_major(cublas_arguments(g2), {"a": a, "b": b, "c": c})
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
        host = c.copy()
        host_gemm(g2, a, b, host)
        np.testing.assert_allclose(host, want, rtol=1e-13, atol=1e-13)


def test_a_batch_that_would_run_past_its_buffer_is_refused():
    g, a, b, c = _case(False, False)
    with pytest.raises(ValueError, match="C spans"):
        _check_span(g, a, b, c[:-1])
    with pytest.raises(ValueError, match="leading dimension"):
        _check_span(GemmBatch(**{**g.__dict__, "lda": 1}), a, b, c)
    with pytest.raises(ValueError, match="C-contiguous"):
        HostBatchedGemm()(g, a, b, np.zeros((len(c), 2))[:, 0])
