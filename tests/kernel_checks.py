"""What the per-op kernel tests (tests/test_<op>.py) share: finite differences, tolerances, data
and the CUDA tests' marks.

Each op's test file holds the op's NumPy reference, its float64 finite-difference gradient test,
the CPU twin's tests, and its CUDA kernels against the twin - on numba's CUDA simulator here
(conftest sets NUMBA_ENABLE_CUDASIM=1; every simulated thread is a Python thread, so shapes stay
small) and on a real GPU in the GPU pass (scripts/cuda-tests.txt), where the cases marked ``gpu``
add realistic sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.compress import Context
from hpctrain.device import cuda_status, simulated

# (B, I, O) for linear; the same triples are used as 3-D shapes for the
# elementwise ops and (B, O) for softmax: batch 1, all-ones and odd sizes.
SHAPES = [(1, 1, 1), (3, 5, 7), (17, 13, 6)]
EPS = 1e-6
# Central differences with eps=1e-6 in float64: truncation ~eps^2*f''' ~1e-12,
# rounding ~1e-16*|terms|/eps ~1e-10, both far below rtol=1e-6 of O(1e-3..1)
# gradients; atol=1e-9 covers entries that are (near) zero.
FD_TOL = dict(rtol=1e-6, atol=1e-9)
U32, U64 = 2.0 ** -24, 2.0 ** -53   # float32, float64 unit roundoff
# CUDA against the twin in float64: ~1e-12 relative (the only differences are summation order and
# fused multiply-adds) for results that are not long sums (elementwise, short rows)
TIGHT = dict(rtol=1e-12, atol=1e-13)

gpu = pytest.mark.gpu   # realistic sizes: a real GPU only (scripts/test.sh's GPU pass)
# a CUDA test where numba.cuda cannot run (the simulator off and no GPU) is skipped, not failed
needs_cuda = pytest.mark.skipif(cuda_status()[0] == 0, reason=f"numba.cuda unusable: {cuda_status()[1]}")


def rng_for(*key):
    """The CPU tests' data."""
    return np.random.default_rng([2024, *key])


def rng_cuda(*key):
    """The CUDA tests' data (the seeds they had in tests/test_cuda_kernels.py)."""
    return np.random.default_rng([3031, *key])


def rng_gpt_cuda(*key):
    """The GPT ops' CUDA tests' data (the seeds they had in tests/test_gpt_cuda_kernels.py)."""
    return np.random.default_rng([4041, *key])


def fd_grad(terms, x, eps=EPS):
    """Central differences of objective = terms().sum() w.r.t. every entry of ``x``.

    ``terms()`` recomputes the per-element contributions from the current ``x``
    (modified in place). The +/- results are subtracted elementwise before
    summing so that entries the perturbation does not touch cancel exactly
    instead of adding the rounding error of a large sum.
    """
    assert x.flags.c_contiguous and x.dtype == np.float64
    flat = x.reshape(-1)
    grad = np.empty(flat.size)
    for i in range(flat.size):
        old = flat[i]
        xp, xm = old + eps, old - eps
        flat[i] = xp
        tp = np.array(terms(), dtype=np.float64, copy=True)
        flat[i] = xm
        tm = np.array(terms(), dtype=np.float64, copy=True)
        flat[i] = old
        grad[i] = np.sum(tp - tm) / (xp - xm)  # xp - xm: the step actually taken
    return grad.reshape(x.shape)


def assert_sums_close(got, ref, abs_terms, n):
    """Two n-term float64 sums in different orders: each is within gamma_n * sum|terms|
    of the exact value (gamma_n ~ n u), so they differ by at most twice that.
    The bound grows with n, so it holds at GPU sizes too (TIGHT would not)."""
    bound = 2 * (n + 2) * U64 * abs_terms
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / np.maximum(bound, 1e-300))


def down(dev, a):
    """A host copy of device array ``a``."""
    return dev.to_host(a).copy()


# ---- the optimizer ops' data (sgd, adamw; their classes in test_optim.py) ------------------------
P = 37        # odd parameter count
STEPS = 5
LRS = [0.1, 0.07, 0.05, 0.02, 0.01]   # a different lr each step, as a schedule gives
OPT_SIZES = [1, 600, pytest.param(10_000_003, marks=gpu)]   # the CUDA updates' lengths

# float64: the kernel does the reference's arithmetic in the same order, so
# only a few roundings differ over 5 steps.
TOL64 = dict(rtol=1e-12, atol=1e-14)
# float32: the kernel computes in float64 but stores p and the state (v / m, v)
# as float32 after every step, each store a relative error <= 2^-24 ~ 6e-8.
# Over 5 steps that is < ~1e-6 of the O(1) values; rtol 1e-5 / atol 1e-6 keep
# a margin yet catch a wrong term (weight decay alone moves p by lr*wd ~ 1e-3).
TOL32 = dict(rtol=1e-5, atol=1e-6)
TOL = {np.float64: TOL64, np.float32: TOL32}


def problem(dtype, key=0):
    r = np.random.default_rng([7, key])
    p0 = r.standard_normal(P)
    grads = [r.standard_normal(P) * (1 + k) for k in range(STEPS)]  # varying scale too
    return p0.astype(dtype), [g.astype(dtype) for g in grads]


# ---- the compression ops (quantize16, sign_pack, topk_threshold, gather_scatter, ef) --------------
# Tolerance: none. Every kernel does the same float32 operations as the host compressor, element
# by element (or sums in the one documented order), so the results are compared bit for bit
# (through uint views, so -0.0 and NaN count). One exception, as kernels/quantize16.py documents:
# on a real GPU, arithmetic on a NaN returns the canonical NaN (0x7FFFFFFF), not x86's (sign and
# payload kept), so a GPU result that is NaN where the host's is NaN counts as equal
# (``assert_same_bits_gpu``); every other element is still compared bit for bit. The simulator's
# grid is capped at 2 blocks of 256 threads, so sizes of 4097 and more span both blocks and make
# the grid-stride loops turn; 0, 1 and 7 are the ragged edges (empty, one element, a partial byte
# of signs).
SIZES = [0, 1, 7, 4097]
CTX = Context(step=0, bucket=0)


def bits_of(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same_bits(got, ref):
    np.testing.assert_array_equal(bits_of(got), bits_of(np.asarray(ref, got.dtype)))


# NaN codes of the 16-bit formats: exponent all ones, mantissa not zero
_NAN16 = {"fp16": (0x7C00, 0x03FF), "bf16": (0x7F80, 0x007F)}


def _is_nan(a, fmt=None):
    if fmt is None:
        return np.isnan(a)
    exp, man = _NAN16[fmt]
    return ((a & exp) == exp) & ((a & man) != 0)


def assert_same_bits_gpu(got, ref, fmt=None):
    """Bit for bit, except that on a real GPU a NaN may be any NaN (the GPU's is canonical;
    the simulator's arithmetic is NumPy's, so there the bits must match exactly).

    ``fmt`` names the 16-bit format when ``got`` holds fp16/bf16 codes."""
    if simulated():
        np.testing.assert_array_equal(bits_of(got), bits_of(np.asarray(ref, got.dtype)))
        return
    ref = np.asarray(ref, got.dtype)
    nan = _is_nan(ref, fmt)
    np.testing.assert_array_equal(_is_nan(got, fmt), nan, err_msg="NaN where the host has none, or the reverse")
    np.testing.assert_array_equal(bits_of(got)[~nan], bits_of(ref)[~nan])


def gradient(n, seed=0):
    return np.random.default_rng([77, n, seed]).standard_normal(n).astype(np.float32)
