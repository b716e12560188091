"""The 16-bit wire formats of compression (hpctrain/kernels/quantize16.py): the CUDA kernels bit
for bit the host compressors (Fp16, Bf16), error feedback fused, and every 16-bit pattern decoded
(tolerance: none, kernel_checks.py says why; NaN payloads aside on a real GPU). The twin's own
round trips are tests/test_compress_core.py's (the host compressors run it).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import up
from hpctrain.compress import Bf16, Fp16
from hpctrain.kernels import quantize16
from kernel_checks import SIZES, assert_same_bits, assert_same_bits_gpu, needs_cuda

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf - inf, NaN casts: on purpose


SPECIAL = np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, -np.nan, 65504, 65519.99, 65520, 1e5,
                    2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -24, 2.0 ** -14, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11,
                    1 + 2.0 ** -8, 3.4e38, -3.4028235e38, 1e-40], np.float32)


def quantize_inputs(n, dtype):
    r = np.random.default_rng([78, n])
    x = (r.standard_normal(n) * 10.0 ** r.integers(-9, 6, n)).astype(np.float32)
    x[:min(n, SPECIAL.size)] = SPECIAL[:n]
    resid = (r.standard_normal(n) * 1e-3).astype(np.float32)
    return x.astype(dtype), resid


# ---- CUDA kernels against the host compressors -------------------------------------------
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", SIZES + [SPECIAL.size])
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_quantize16_encode_ef_equals_host_compressor(dev32, fmt, n, dtype):
    x, r0 = quantize_inputs(n, dtype)
    host = {"fp16": Fp16(), "bf16": Bf16()}[fmt]
    corrected = x.astype(np.float32) + r0                # the host ErrorFeedback.step
    ref_bits = host.encode(corrected)
    ref_r = corrected - host.decode(ref_bits)
    code = quantize16.FORMATS[fmt]
    twin_r, twin_bits = r0.copy(), np.empty(n, np.uint16)
    quantize16.encode_ef(x, twin_r, twin_bits, code)
    R, B = up(dev32, r0), dev32.empty(n, np.uint16)
    quantize16.encode_ef_cuda(up(dev32, x), R, B, code, stream=dev32.stream)
    np.testing.assert_array_equal(twin_bits, ref_bits)
    assert_same_bits(twin_r, ref_r)
    assert_same_bits_gpu(dev32.to_host(B), ref_bits, fmt)
    assert_same_bits_gpu(dev32.to_host(R), ref_r)


@needs_cuda
@pytest.mark.parametrize("out_dtype", ["float32", "float64"])
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_quantize16_decode_every_bit_pattern(dev32, fmt, out_dtype):
    every = np.arange(1 << 16, dtype=np.uint16)
    ref = {"fp16": Fp16, "bf16": Bf16}[fmt].decode(every).astype(out_dtype)
    code = quantize16.FORMATS[fmt]
    assert_same_bits(quantize16.decode(every, np.empty(every.size, out_dtype), code), ref)
    OUT = dev32.empty(every.size, out_dtype)
    quantize16.decode_cuda(up(dev32, every), OUT, code, stream=dev32.stream)
    assert_same_bits(dev32.to_host(OUT), ref)
