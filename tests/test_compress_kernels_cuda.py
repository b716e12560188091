"""Compression kernels (hpctrain/kernels: quantize16, sign_pack, topk_threshold,
gather_scatter, ef) against their CPU twins and the host compressors.

Without a GPU these run on numba's CUDA simulator (conftest sets
NUMBA_ENABLE_CUDASIM=1), whose grid is capped at 2 blocks of 256 threads, so
sizes of 4097 and more span both blocks and make the grid-stride loops turn;
0, 1 and 7 are the ragged edges (empty, one element, a partial byte of signs).

Tolerance: none. Every kernel does the same float32 operations as the host
compressor, element by element (or sums in the one documented order), so the
results are compared bit for bit (through uint views, so -0.0 and NaN count).
One exception, as kernels/quantize16.py documents: on a real GPU, arithmetic on
a NaN returns the canonical NaN (0x7FFFFFFF), not x86's (sign and payload
kept), so a GPU result that is NaN where the host's is NaN counts as equal
(``assert_same_bits_gpu``); every other element is still compared bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.compress import Bf16, Context, Fp16, Sign, TopK
from hpctrain.compress.sparse import k_of, unpack_indices
from hpctrain.device import CudaDevice, cuda_status, simulated
from hpctrain.kernels import ef, gather_scatter, quantize16, sign_pack, topk_threshold
from conftest import up
from topk_cases import TOPK_CASES, adversarial, expected_road

pytestmark = [pytest.mark.skipif(cuda_status()[0] == 0, reason=f"numba.cuda unusable: {cuda_status()[1]}"),
              pytest.mark.filterwarnings("ignore:invalid value encountered")]  # inf - inf, NaN casts: on purpose

SIZES = [0, 1, 7, 4097]
CTX = Context(step=0, bucket=0)


@pytest.fixture(scope="module")
def dev():
    return CudaDevice("float32")


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


# ---- fp16 / bf16 -----------------------------------------------------------------------
SPECIAL = np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, -np.nan, 65504, 65519.99, 65520, 1e5,
                    2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -24, 2.0 ** -14, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11,
                    1 + 2.0 ** -8, 3.4e38, -3.4028235e38, 1e-40], np.float32)


def quantize_inputs(n, dtype):
    r = np.random.default_rng([78, n])
    x = (r.standard_normal(n) * 10.0 ** r.integers(-9, 6, n)).astype(np.float32)
    x[:min(n, SPECIAL.size)] = SPECIAL[:n]
    resid = (r.standard_normal(n) * 1e-3).astype(np.float32)
    return x.astype(dtype), resid


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", SIZES + [SPECIAL.size])
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_quantize16_encode_ef_equals_host_compressor(dev, fmt, n, dtype):
    x, r0 = quantize_inputs(n, dtype)
    host = {"fp16": Fp16(), "bf16": Bf16()}[fmt]
    corrected = x.astype(np.float32) + r0                # the host ErrorFeedback.step
    ref_bits = host.encode(corrected)
    ref_r = corrected - host.decode(ref_bits)
    code = quantize16.FORMATS[fmt]
    twin_r, twin_bits = r0.copy(), np.empty(n, np.uint16)
    quantize16.encode_ef(x, twin_r, twin_bits, code)
    R, B = up(dev, r0), dev.empty(n, np.uint16)
    quantize16.encode_ef_cuda(up(dev, x), R, B, code, stream=dev.stream)
    np.testing.assert_array_equal(twin_bits, ref_bits)
    assert_same_bits(twin_r, ref_r)
    assert_same_bits_gpu(dev.to_host(B), ref_bits, fmt)
    assert_same_bits_gpu(dev.to_host(R), ref_r)


@pytest.mark.parametrize("out_dtype", ["float32", "float64"])
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_quantize16_decode_every_bit_pattern(dev, fmt, out_dtype):
    every = np.arange(1 << 16, dtype=np.uint16)
    ref = {"fp16": Fp16, "bf16": Bf16}[fmt].decode(every).astype(out_dtype)
    code = quantize16.FORMATS[fmt]
    assert_same_bits(quantize16.decode(every, np.empty(every.size, out_dtype), code), ref)
    OUT = dev.empty(every.size, out_dtype)
    quantize16.decode_cuda(up(dev, every), OUT, code, stream=dev.stream)
    assert_same_bits(dev.to_host(OUT), ref)


# ---- sign --------------------------------------------------------------------------------
# (n, chunk): ragged sizes; several chunks per block (the simulator's chunk loop is
# slow: a barrier per halving); a short last chunk; chunks of the default size
SIGN_CASES = [(0, 64), (1, 64), (7, 64), (700, 64), (4097, 300), (4097, 4096), (5000, 4096)]


@pytest.mark.parametrize("n, chunk", SIGN_CASES)
def test_sign_encode_ef_equals_host_compressor(dev, n, chunk):
    x = gradient(n) * np.float32(3)
    x[::11] = 0.0                                        # zeros encode as +, and -0.0 too
    x[5::13] = -0.0
    r0 = gradient(n, 1) * np.float32(0.1)
    host = Sign(chunk)
    corrected = x + r0
    ref = host.compress(corrected, CTX)
    ref_r = corrected - host.decompress(ref, n, CTX)
    nc, nb = -(-n // chunk), -(-n // 8)
    R, S, B = up(dev, r0), dev.empty(nc), dev.empty(nb, np.uint8)
    sign_pack.chunk_scales_ef_cuda(up(dev, x.astype(np.float64)), R, chunk, S, stream=dev.stream)
    sign_pack.pack_ef_cuda(R, S, chunk, B, stream=dev.stream)
    np.testing.assert_array_equal(dev.to_host(B), ref["bits"])
    assert_same_bits(dev.to_host(S), ref["scales"])
    assert_same_bits(dev.to_host(R), ref_r)
    # the twin of the pack kernel
    c, bits = corrected.copy(), np.empty(nb, np.uint8)
    sign_pack.pack_ef(c, ref["scales"], chunk, bits)
    np.testing.assert_array_equal(bits, ref["bits"])
    assert_same_bits(c, ref_r)


def test_sign_scales_follow_the_documented_order_not_numpy_sum():
    # magnitudes spanning 2^60: float64 sums differ with the order, the twin's order is the contract
    x = (np.random.default_rng(5).standard_normal(4096) * 2.0 ** (np.arange(4096) % 61)).astype(np.float32)
    scales = sign_pack.chunk_scales(x, 4096, np.empty(1, np.float32))
    partial = [np.float64(0)] * 256
    for t in range(256):
        for i in range(t, 4096, 256):
            partial[t] += abs(np.float64(x[i]))
    half = 128
    while half:
        partial[:half] = [partial[t] + partial[t + half] for t in range(half)]
        half //= 2
    assert_same_bits(scales, [np.float32(partial[0] / 4096)])


@pytest.mark.parametrize("out_dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [1, 7, 4097])
def test_sign_unpack_sum_equals_host_decode_in_rank_order(dev, n, out_dtype):
    host, p = Sign(64), 3
    payloads = [host.compress(gradient(n, rank) * np.float32(rank + 1), CTX) for rank in range(p)]
    total = np.zeros(n, np.float32)
    for pl in payloads:
        total += host.decompress(pl, n, CTX)
    bits, scales = np.stack([pl["bits"] for pl in payloads]), np.stack([pl["scales"] for pl in payloads])
    assert_same_bits(sign_pack.unpack_sum(bits, scales, 64, np.empty(n, out_dtype)), total)
    OUT = dev.empty(n, out_dtype)
    sign_pack.unpack_sum_cuda(up(dev, bits), up(dev, scales), 64, OUT, stream=dev.stream)
    assert_same_bits(dev.to_host(OUT), total)


# ---- top-k -------------------------------------------------------------------------------
@pytest.mark.parametrize("name, n, ratio", TOPK_CASES)
def test_topk_cuda_selects_exactly_the_host_set(dev, name, n, ratio):
    x = adversarial(name, n)
    k = k_of(ratio, n)
    ref = topk_threshold.topk_select(x, k)             # the reference: numpy.partition
    found = topk_threshold.topk_cuda(up(dev, x), k, stream=dev.stream, scratch=dev.scratch)
    np.testing.assert_array_equal(found.indices, ref)
    assert_same_bits(found.values, x[ref])
    p = TopK(ratio).compress(x, CTX)                   # the host path, through its payload
    np.testing.assert_array_equal(unpack_indices(p["offsets"], p["block_counts"]), ref)
    assert_same_bits(p["values"], x[ref])
    assert found.indices.dtype == np.int32 and found.indices.size == k
    # which road it took: the adversarial inputs are built to take the retry and fallback roads
    fallback, passes = expected_road(name, n, k)
    assert found.fallback == fallback, found
    if passes is not None:
        assert found.passes == passes, found


def test_topk_order_ties_go_to_smaller_indices_and_nan_is_largest():
    x = np.array([1.0, -2.0, 2.0, np.nan, 0.5, -2.0, 2.0], np.float32)
    np.testing.assert_array_equal(topk_threshold.topk_select(x, 1), [3])          # NaN above all
    np.testing.assert_array_equal(topk_threshold.topk_select(x, 3), [1, 2, 3])    # first two of four 2s
    np.testing.assert_array_equal(topk_threshold.topk_select(x, 6), [0, 1, 2, 3, 5, 6])
    p = TopK(3 / 7).compress(x, CTX)
    np.testing.assert_array_equal(unpack_indices(p["offsets"], p["block_counts"]), [1, 2, 3])


@pytest.mark.parametrize("n", [1, 7, 4097])
def test_threshold_compaction_finds_the_twins_set(dev, n):
    x = adversarial("nan_inf", n) if n > 400 else gradient(n)
    t = np.float32(min(0.7, np.nanmax(np.abs(x))))
    cap = n
    ref_i, ref_v = np.empty(cap, np.int32), np.empty(cap, np.float32)
    count = topk_threshold.threshold_compact(x, t, ref_i, ref_v)
    I, V, C = dev.empty(cap, np.int32), dev.empty(cap), up(dev, np.zeros(1, np.int32))
    topk_threshold.threshold_compact_cuda(up(dev, x), t, I, V, C, stream=dev.stream)
    assert int(dev.to_host(C)[0]) == count > 0
    got_i, got_v = dev.to_host(I)[:count], dev.to_host(V)[:count]
    order = np.argsort(got_i)          # atomics hand out slots in any order
    np.testing.assert_array_equal(got_i[order], ref_i[:count])
    assert_same_bits(got_v[order], ref_v[:count])


# ---- sparse take / scatter and the elementwise EF steps ---------------------------------------
@pytest.mark.parametrize("n", [1, 7, 4097])
def test_sparse_take_and_scatter_match_twins(dev, n):
    r0 = gradient(n)
    r0[0] = np.inf
    idx = np.sort(np.random.default_rng(n).choice(n, size=max(1, n // 3), replace=False)).astype(np.int32)
    r_ref, v_ref = r0.copy(), np.empty(idx.size, np.float32)
    gather_scatter.sparse_take(r_ref, idx, v_ref)
    R, V, I = up(dev, r0), dev.empty(idx.size), up(dev, idx)
    gather_scatter.sparse_take_cuda(R, I, V, stream=dev.stream)
    assert_same_bits(dev.to_host(V), v_ref)
    assert_same_bits_gpu(dev.to_host(R), r_ref)     # inf - inf: NaN
    base = gradient(n, 2).astype(np.float64)
    for accumulate in (False, True):
        ref = gather_scatter.sparse_scatter(base.copy(), idx, v_ref, accumulate)
        OUT = up(dev, base)
        gather_scatter.sparse_scatter_cuda(OUT, I, V, accumulate, stream=dev.stream)
        assert_same_bits(dev.to_host(OUT), ref)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", SIZES)
def test_elementwise_ef_steps_match_twins(dev, n, dtype):
    x, r0, a = gradient(n).astype(dtype), gradient(n, 1), gradient(n, 2)
    R = up(dev, r0)
    ef.ef_correct_cuda(up(dev, x), R, stream=dev.stream)
    assert_same_bits(dev.to_host(R), ef.ef_correct(x, r0.copy()))
    ef.lowrank_residual_cuda(R, up(dev, a), 3, stream=dev.stream)
    assert_same_bits(dev.to_host(R), ef.lowrank_residual(ef.ef_correct(x, r0.copy()), a, 3))
    OUT = dev.empty(n, dtype)
    ef.cast_copy_cuda(R, OUT, stream=dev.stream)
    assert_same_bits(dev.to_host(OUT), ef.cast_copy(dev.to_host(R), np.empty(n, dtype)))
    ef.fill_cuda(OUT, 0, stream=dev.stream)
    assert_same_bits(dev.to_host(OUT), np.zeros(n, dtype))
