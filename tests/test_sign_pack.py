"""1-bit sign compression (hpctrain/kernels/sign_pack.py): the CUDA kernels bit for bit the host
compressor (Sign), the scales in the documented summation order, and the unpack-and-sum in rank
order (tolerance: none, kernel_checks.py says why). The twin's own packing is
tests/test_compress_core.py's (the host compressor runs it).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import up
from hpctrain.compress import Sign
from hpctrain.kernels import sign_pack
from kernel_checks import CTX, assert_same_bits, gradient, needs_cuda

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf - inf, NaN casts: on purpose


# (n, chunk): ragged sizes; several chunks per block (the simulator's chunk loop is
# slow: a barrier per halving); a short last chunk; chunks of the default size
SIGN_CASES = [(0, 64), (1, 64), (7, 64), (700, 64), (4097, 300), (4097, 4096), (5000, 4096)]


# ---- CPU twin ----------------------------------------------------------------------------
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


# ---- CUDA kernels against the host compressor --------------------------------------------
@needs_cuda
@pytest.mark.parametrize("n, chunk", SIGN_CASES)
def test_sign_encode_ef_equals_host_compressor(dev32, n, chunk):
    x = gradient(n) * np.float32(3)
    x[::11] = 0.0                                        # zeros encode as +, and -0.0 too
    x[5::13] = -0.0
    r0 = gradient(n, 1) * np.float32(0.1)
    host = Sign(chunk)
    corrected = x + r0
    ref = host.compress(corrected, CTX)
    ref_r = corrected - host.decompress(ref, n, CTX)
    nc, nb = -(-n // chunk), -(-n // 8)
    R, S, B = up(dev32, r0), dev32.empty(nc), dev32.empty(nb, np.uint8)
    sign_pack.chunk_scales_ef_cuda(up(dev32, x.astype(np.float64)), R, chunk, S, stream=dev32.stream)
    sign_pack.pack_ef_cuda(R, S, chunk, B, stream=dev32.stream)
    np.testing.assert_array_equal(dev32.to_host(B), ref["bits"])
    assert_same_bits(dev32.to_host(S), ref["scales"])
    assert_same_bits(dev32.to_host(R), ref_r)
    # the twin of the pack kernel
    c, bits = corrected.copy(), np.empty(nb, np.uint8)
    sign_pack.pack_ef(c, ref["scales"], chunk, bits)
    np.testing.assert_array_equal(bits, ref["bits"])
    assert_same_bits(c, ref_r)


@needs_cuda
@pytest.mark.parametrize("out_dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [1, 7, 4097])
def test_sign_unpack_sum_equals_host_decode_in_rank_order(dev32, n, out_dtype):
    host, p = Sign(64), 3
    payloads = [host.compress(gradient(n, rank) * np.float32(rank + 1), CTX) for rank in range(p)]
    total = np.zeros(n, np.float32)
    for pl in payloads:
        total += host.decompress(pl, n, CTX)
    bits, scales = np.stack([pl["bits"] for pl in payloads]), np.stack([pl["scales"] for pl in payloads])
    assert_same_bits(sign_pack.unpack_sum(bits, scales, 64, np.empty(n, out_dtype)), total)
    OUT = dev32.empty(n, out_dtype)
    sign_pack.unpack_sum_cuda(up(dev32, bits), up(dev32, scales), 64, OUT, stream=dev32.stream)
    assert_same_bits(dev32.to_host(OUT), total)
