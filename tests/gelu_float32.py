"""The float32 GELU's error bound, shared by the CPU-twin and CUDA tests.

Both evaluate gelu(v) = v s, gelu'(v) = s + B (1 - s) with s = 1 / (1 + exp(-2u)),
u = k (v + c v^3), B = 2 v s k (1 + 3 c v^2), every step rounded in float32
(bias_act.py). Each of the ~10 roundings adds at most u32 = 2^-24 relative, and
exp turns the relative error of its argument into an error in s amplified by
exp's condition number there, 2|u| (1 - s). So, with a floor for results that
underflow (float32 subnormals near v = -10 keep few bits; such values never matter):

    |gelu_f32 - gelu| <= 16 u32 |gelu| (1 + 2|u|(1 - s)) + 1e-30
    |gelu'_f32 - gelu'| <= 16 u32 (s + |B|) (1 + 2|u|(1 - s)) + 1e-30

16 leaves room above the ~3 measured on a dense grid of v in [-12, 12] for
exp/expf implementations (NumPy's SIMD exp, CUDA's expf: each within 2 ulp).
"""

import math

import numpy as np

U32 = 2.0 ** -24
FLOOR = 1e-30


def gelu_reference(z):
    """(gelu, gelu', forward bound, derivative bound) of float32 inputs, in float64."""
    v = np.asarray(z, np.float64)
    k = math.sqrt(2.0 / math.pi)
    u = k * (v + 0.044715 * v ** 3)
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-2.0 * u))
    big_b = 2.0 * v * s * k * (1.0 + 3.0 * 0.044715 * v ** 2)
    cond = 1.0 + 2.0 * np.abs(u) * (1.0 - s)
    out, grad = v * s, s + big_b * (1.0 - s)
    return out, grad, 16 * U32 * np.abs(out) * cond + FLOOR, 16 * U32 * (s + np.abs(big_b)) * cond + FLOOR


def assert_gelu_float32(out, dz, db, z, dout):
    """out = gelu(z), dz = dout * gelu'(z), db = column sums of dz, all within the bounds above
    (db: the dz bounds summed, plus the float64 sum's own rounding, negligible)."""
    ref, grad, b_out, b_grad = gelu_reference(z)
    dout = np.asarray(dout, np.float64)
    assert np.all(np.abs(out - ref) <= b_out), np.max(np.abs(out - ref) / b_out)
    b_dz = np.abs(dout) * b_grad + U32 * np.abs(dout * grad)  # + the product's rounding
    assert np.all(np.abs(dz - dout * grad) <= b_dz), np.max(np.abs(dz - dout * grad) / b_dz)
    b_db = b_dz.sum(axis=0) + 1e-12
    assert np.all(np.abs(db - (dout * grad).sum(axis=0)) <= b_db)
