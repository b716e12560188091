"""Compressors one rank at a time: round-trip bounds, packing, overflow, error feedback,
PowerSGD exactness. (Wiring into the all-reduce and multi-rank tests come with it.)"""

import numpy as np
import pytest

from hpctrain.compress import (Bf16, Context, ErrorFeedback, Fp16, PowerSGD, RandK, Sign, TopK,
                               make_compressor, payload_bytes)
from hpctrain.compress.sparse import INDEX_BLOCK, k_of, pack_indices, payload_indices, unpack_indices

CTX = Context(step=3, bucket=1, seed=7)


def same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _x(n, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


@pytest.mark.parametrize("spec,cls", [("none", None), ("fp16", Fp16), ("bf16", Bf16), ("topk(0.01)", TopK),
                                      ("randk(0.5)", RandK), ("sign", Sign), ("powersgd(4)", PowerSGD),
                                      ("powersgd(4, 10)", PowerSGD)])
def test_make_compressor_parses_specs(spec, cls):
    c = make_compressor(spec)
    assert cls is None or isinstance(c, cls)


@pytest.mark.parametrize("bad", ["topk", "topk(0)", "topk(2)", "zip", "powersgd(0)", "randk(a)", "sign(3)"])
def test_bad_specs_name_the_problem(bad):
    with pytest.raises(ValueError, match="compressor"):
        make_compressor(bad)


def test_fp16_round_trip_bound_and_saturation():
    c = Fp16()
    x = _x(10001, scale=100.0)
    y = c.decompress(c.compress(x, CTX), x.size, CTX)
    # normal range: relative error <= 2^-11; below 2^-14 the spacing is absolute 2^-24
    assert np.all(np.abs(y - x) <= np.maximum(np.abs(x) * 2.0**-11, 2.0**-24))
    big = np.array([1e5, -7e4, 65504, 3.0, np.nan], np.float32)
    y = c.decompress(c.compress(big, CTX), 5, CTX)
    np.testing.assert_array_equal(y[:4], [65504, -65504, 65504, 3.0])  # saturated, not inf
    assert np.isnan(y[4]) and c.saturated == 2
    assert payload_bytes(c.compress(x, CTX)) == 2 * x.size


def test_fp16_overflow_is_not_lost_with_error_feedback():
    ef = ErrorFeedback(Fp16())
    g = np.array([1e5, 1.0], np.float32)
    sent = sum(Fp16().decompress(ef.step(g if s == 0 else np.zeros(2, np.float32), Context(s, 0)), 2, CTX)
               for s in range(3))
    np.testing.assert_allclose(sent, g, rtol=1e-6)  # 65504 + 34496 arrive over two steps


def test_bf16_rounds_to_nearest_even_and_keeps_range():
    c = Bf16()
    x = np.concatenate([_x(5000, scale=1e30), _x(5000, scale=1e-30), [0.0, -0.0, 1.0, np.inf, -np.inf]]).astype(np.float32)
    y = c.decompress(c.compress(x, CTX), x.size, CTX)
    finite = np.isfinite(x)
    assert np.all(np.abs(y[finite] - x[finite]) <= np.abs(x[finite]) * 2.0**-8)
    np.testing.assert_array_equal(y[~finite], x[~finite])
    # ties go to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 -> 1 (even mantissa)
    tie = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8], np.float32)
    np.testing.assert_array_equal(c.decompress(c.compress(tie, CTX), 2, CTX), [1.0, 1 + 2.0**-6])
    top = np.array([np.finfo(np.float32).max, np.nan], np.float32)
    y = c.decompress(c.compress(top, CTX), 2, CTX)
    assert np.isfinite(y[0]) and y[0] > 3.38e38 and np.isnan(y[1])  # saturated, NaN kept


def test_topk_keeps_the_largest_magnitudes_exactly():
    x = _x(1000)
    c = TopK(0.05)
    p = c.compress(x, CTX)
    k = k_of(0.05, 1000)
    idx = unpack_indices(p["offsets"], p["block_counts"])
    # 16-bit offsets and float32 values, plus one int32 count per 65536-entry block
    assert idx.size == k == 50 and payload_bytes(p) == 6 * k + 4
    y = c.decompress(p, x.size, CTX)
    threshold = np.sort(np.abs(x))[-k]
    assert np.all(np.abs(x[idx]) >= threshold)
    np.testing.assert_array_equal(y[idx], x[idx])
    assert np.count_nonzero(y) == k


def test_topk_index_packing_round_trips_across_blocks():
    n = 3 * INDEX_BLOCK + 5
    edges = [0, 1, INDEX_BLOCK - 1, INDEX_BLOCK, 2 * INDEX_BLOCK + 7, n - 1]  # block 1 ends, 3 is short
    rng = np.random.default_rng(3)
    for idx in (np.array(edges), np.sort(rng.choice(n, 2000, replace=False)), np.arange(n),
                np.zeros(0, np.int64)):
        packed = pack_indices(idx, n)
        assert packed["offsets"].dtype == np.uint16 and packed["block_counts"].dtype == np.int32
        assert packed["offsets"].size == idx.size and packed["block_counts"].size == 4
        np.testing.assert_array_equal(unpack_indices(**packed), idx)
    counts = pack_indices(np.array(edges), n)["block_counts"]
    np.testing.assert_array_equal(counts, [3, 1, 1, 1])
    for bad in ([70000, 5], [3, 3], [-1, 2], [0, n]):  # would decode to other indices or resize the payload
        with pytest.raises(ValueError, match="ascending and in"):
            pack_indices(np.array(bad), n)
    with pytest.raises(ValueError, match="block counts sum to 5, 6 offsets"):
        unpack_indices(pack_indices(np.array(edges), n)["offsets"], counts - [1, 0, 0, 0])
    # a bucket past one block: the exact top k survives the packing
    x = _x(n)
    c = TopK(0.01)
    p = c.compress(x, CTX)
    k = k_of(0.01, n)
    assert payload_bytes(p) == 6 * k + 4 * 4
    y = c.decompress(p, n, CTX)
    keep = np.argsort(-np.abs(x), kind="stable")[:k]
    np.testing.assert_array_equal(np.flatnonzero(y), np.sort(keep))
    np.testing.assert_array_equal(y[keep], x[keep])


def test_randk_indices_agree_across_ranks_and_differ_across_steps():
    a, b = RandK(0.1), RandK(0.1)  # two "ranks"
    np.testing.assert_array_equal(a.indices(1000, CTX), b.indices(1000, CTX))
    assert not np.array_equal(a.indices(1000, CTX), a.indices(1000, Context(4, 1, 7)))
    x = _x(1000)
    assert payload_bytes(a.compress(x, CTX)) == 4 * 100


def test_sign_packing_is_exact_and_keeps_chunk_l1_norms():
    c = Sign(chunk=64)
    x = _x(1000)
    p = c.compress(x, CTX)
    assert p["bits"].size == 125 and p["scales"].size == 16
    np.testing.assert_array_equal(np.unpackbits(p["bits"], count=1000).astype(bool), x < 0)
    y = c.decompress(p, x.size, CTX)
    np.testing.assert_array_equal(np.sign(y), np.where(x < 0, -1, 1))
    for lo in range(0, 1000, 64):  # every chunk keeps its L1 norm
        np.testing.assert_allclose(np.abs(y[lo:lo + 64]).sum(), np.abs(x[lo:lo + 64]).sum(), rtol=1e-5)
    assert payload_bytes(Sign().compress(_x(1 << 20), CTX)) * 30 < 4 * (1 << 20)


@pytest.mark.parametrize("make", [Fp16, Bf16, lambda: TopK(0.01), lambda: RandK(0.05), Sign])
def test_error_feedback_invariant(make):
    """Over several steps: sum(sent) + final residual == sum(gradients), to float32 rounding."""
    c = make()
    ef = ErrorFeedback(c)
    grads = [_x(3000, seed=s) for s in range(12)]
    sent = np.zeros(3000, np.float64)
    for s, g in enumerate(grads):
        ctx = Context(step=s, bucket=0, seed=1)
        sent += c.decompress(ef.step(g, ctx), g.size, ctx)
    total = np.sum(grads, axis=0, dtype=np.float64)
    np.testing.assert_allclose(sent + ef.residuals[0], total, atol=1e-4 * np.abs(total).max())
    # the checkpoint view round-trips
    again = ErrorFeedback(c)
    again.load_state(ef.state())
    np.testing.assert_array_equal(again.residuals[0], ef.residuals[0])


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")  # inf - inf, as meant
@pytest.mark.parametrize("make", [lambda: TopK(0.05), lambda: Sign(chunk=64), Fp16, Bf16, lambda: RandK(0.1)])
def test_error_feedback_in_place_is_bitwise_the_dense_formula(make):
    """ErrorFeedback.step (in place; topk's sparse subtract) against the plain formula:
    corrected = x + r, payload = compress(corrected), r = corrected - decompress(payload),
    bit for bit, with -0.0, NaN, inf and subnormals in the gradients."""
    c, ref_c = make(), make()
    ef, r = ErrorFeedback(c), np.zeros(3000, np.float32)
    total, ref_total = np.zeros(3000, np.float32), np.zeros(3000, np.float32)
    for step in range(6):
        g = _x(3000, seed=step) * np.float32(2.0 ** (step - 3))
        g[::11], g[5::97] = -0.0, np.float32(1e-45)
        if step == 4:
            g[[7, 8]] = [np.nan, np.inf]
        ctx = Context(step=step, bucket=0, seed=1)
        payload = ef.step(g, ctx)
        corrected = g + r
        ref = ref_c.compress(corrected, ctx)
        r = corrected - ref_c.decompress(ref, g.size, ctx)
        assert sorted(payload) == sorted(ref) and all(same_bits(payload[k], ref[k]) for k in ref), step
        assert same_bits(ef.residuals[0], r), step
        c.add_sent(payload, total, ctx)             # the gathered sum's decode, sparse for topk
        ref_total += ref_c.decompress(ref, g.size, ctx)
        assert same_bits(total, ref_total), step


def test_powersgd_with_full_rank_reproduces_the_matrix():
    m = np.random.default_rng(1).standard_normal((20, 12)).astype(np.float32)
    c = PowerSGD(rank=12)
    assert not c.compresses(m.shape)  # rank 12 would not shrink 20 x 12: sent as it is
    c = PowerSGD(rank=4)
    low = (np.random.default_rng(2).standard_normal((40, 3)) @ np.random.default_rng(3).standard_normal((3, 30)))
    low = low.astype(np.float32)
    (approx,) = c.reduce([low], Context(0, 0), lambda a: a)
    np.testing.assert_allclose(approx, low, atol=1e-4 * np.abs(low).max())  # rank 3 <= 4: exact
    assert np.abs(c.residuals[(0, 0)]).max() <= 1e-4 * np.abs(low).max()


def test_powersgd_error_feedback_and_warm_start():
    c = PowerSGD(rank=2, start_step=1)
    grads = [np.random.default_rng(s).standard_normal((30, 20)).astype(np.float32) for s in range(8)]
    bias = np.ones(5, np.float32)
    sent = np.zeros((30, 20))
    for s, g in enumerate(grads):
        approx, b = c.reduce([g, bias], Context(s, 0), lambda a: a)
        np.testing.assert_array_equal(b, bias)  # vectors travel uncompressed
        sent += approx
        if s == 0:
            np.testing.assert_array_equal(approx, g)  # before start_step: exact, no residual
            assert (0, 0) not in c.residuals
    np.testing.assert_allclose(sent + c.residuals[(0, 0)], np.sum(grads, axis=0), atol=1e-3)
    assert c.payload_bytes([(30, 20), (5,)], step=2) == 4 * 2 * 50 + 4 * 5
    again = PowerSGD(rank=2, start_step=1)
    again.load_state(c.state())
    assert again.q.keys() == c.q.keys() and again.residuals.keys() == c.residuals.keys()


def test_powersgd_approximates_each_part_of_a_fused_matrix_on_its_own():
    """A layer given as (n, k, c) is k matrices n x c side by side (a fused QKV weight): each gets its
    own rank-r power iteration from its rows of the stacked Q, as a float64 reference computes it
    part by part; parts of rank <= r come back exact, which one rank-r approximation of the whole
    n x kc matrix (rank k r) cannot do. The bytes are k r (n + c), Q keeps its (kc, r) shape, and the
    momentum mask removes each part's own sent subspace from the velocity."""
    n, k, c, r = 24, 3, 10, 2
    rng = np.random.default_rng(7)
    low = np.concatenate([rng.standard_normal((n, r)) @ rng.standard_normal((r, c)) for _ in range(k)], axis=1)
    ctx = Context(0, 0, seed=4)
    q0 = PowerSGD.initial_q(ctx, 0, k * c, r).astype(np.float64)
    for g in (low, rng.standard_normal((n, k * c))):
        g = g.astype(np.float32)
        c_parts = PowerSGD(rank=r)
        (approx,) = c_parts.reduce([g.reshape(n, k, c)], ctx, lambda a: a)
        assert approx.shape == (n, k * c) and c_parts.q[(0, 0)].shape == (k * c, r)
        want = []
        for j in range(k):
            mj, qj = g[:, j * c:(j + 1) * c].astype(np.float64), q0[j * c:(j + 1) * c]
            p_hat = np.linalg.qr(mj @ qj)[0]
            want.append(p_hat @ (mj.T @ p_hat).T)
        want = np.concatenate(want, axis=1)
        np.testing.assert_allclose(approx, want, rtol=0, atol=1e-5 * np.abs(want).max())
        np.testing.assert_allclose(c_parts.residuals[(0, 0)], g - approx, rtol=0, atol=1e-6 * np.abs(g).max())
    (approx,) = PowerSGD(rank=r).reduce([low.astype(np.float32).reshape(n, k, c)], ctx, lambda a: a)
    np.testing.assert_allclose(approx, low, rtol=0, atol=1e-4 * np.abs(low).max())   # each part: exact
    (whole,) = PowerSGD(rank=r).reduce([low.astype(np.float32)], ctx, lambda a: a)
    assert np.abs(whole - low).max() > 0.1 * np.abs(low).max()                          # as one matrix: not
    assert PowerSGD(rank=r).payload_bytes([(n, k, c)], step=0) == 4 * k * r * (n + c)
    assert PowerSGD(rank=4).compresses((8, 3, 8)) is False and PowerSGD(rank=4).compresses((8, 24)) is True
    mom = PowerSGD(rank=r)
    g = rng.standard_normal((n, k * c)).astype(np.float32)
    mom.reduce([g.reshape(n, k, c)], ctx, lambda a: a, 1, BETA)
    u = mom.velocities[(0, 0)]
    for j in range(k):
        mj = (g[:, j * c:(j + 1) * c] * np.float32(1 - BETA)).astype(np.float64)
        p_hat = np.linalg.qr(mj @ q0[j * c:(j + 1) * c])[0]
        assert np.abs(p_hat.T @ u[:, j * c:(j + 1) * c]).max() < 1e-5 * np.abs(mj).max()
        assert np.abs(u[:, j * c:(j + 1) * c]).max() > 0.1 * np.abs(mj).max()


# ---- momentum correction (dist.compress_momentum) -------------------------------------------------
BETA = 0.9


@pytest.mark.parametrize("make", [lambda: TopK(0.05), lambda: RandK(0.1), Fp16, Bf16, lambda: Sign(chunk=64)])
def test_momentum_correction_is_the_dgc_formula_bit_for_bit(make):
    """With momentum: u = b u + (1-b) g; corrected = u + r; payload = compress(corrected);
    r = corrected - decompress(payload); and u zeroed where a sparse payload sent the entry
    (dense compressors mask nothing), bit for bit over several steps."""
    c, ref_c = make(), make()
    ef = ErrorFeedback(c, BETA)
    u, r = np.zeros(3000, np.float32), np.zeros(3000, np.float32)
    masked = False
    for step in range(6):
        g = _x(3000, seed=step) * np.float32(2.0 ** (step - 3))
        ctx = Context(step=step, bucket=2, seed=1)
        payload = ef.step(g, ctx)
        u = np.float32(BETA) * u + np.float32(1 - BETA) * g
        corrected = u + r
        ref = ref_c.compress(corrected, ctx)
        sent = ref_c.decompress(ref, g.size, ctx)
        r = corrected - sent
        if isinstance(ref_c, (TopK, RandK)):
            u[ref_c.indices(g.size, ctx) if isinstance(ref_c, RandK) else payload_indices(ref)] = 0.0
            masked = True
        assert all(same_bits(payload[k], ref[k]) for k in ref), step
        assert same_bits(ef.residuals[2], r) and same_bits(ef.velocities[2], u), step
    if masked:  # the mask leaves zeros where entries went out: a sparse velocity has holes
        assert np.count_nonzero(ef.velocities[2] == 0) >= k_of(0.05, 3000)
    # the checkpoint view carries the velocity, and an empty state resets it (the guard's reset)
    again = ErrorFeedback(make(), BETA)
    again.load_state(ef.state())
    assert same_bits(again.velocities[2], ef.velocities[2]) and same_bits(again.residuals[2], ef.residuals[2])
    again.load_state({})
    assert again.velocities == {} and again.residuals == {}


def test_momentum_correction_sends_the_velocities_sum_for_a_dense_compressor():
    """Without a mask (fp16): sum(sent) + final residual == sum of the velocities, to rounding; so
    the optimizer receives Adam's first moment, delayed only by what the residual holds."""
    ef = ErrorFeedback(Fp16(), BETA)
    u, us = np.zeros(3000), np.zeros(3000)
    sent = np.zeros(3000)
    for s in range(12):
        g = _x(3000, seed=s)
        ctx = Context(step=s, bucket=0, seed=1)
        sent += Fp16().decompress(ef.step(g, ctx), g.size, ctx)
        u = BETA * u + (1 - BETA) * g
        us += u
    np.testing.assert_allclose(sent + ef.residuals[0], us, atol=1e-5 * np.abs(us).max())
    assert not np.allclose(us, np.sum([_x(3000, seed=s) for s in range(12)], axis=0), atol=1e-2)


def test_powersgd_momentum_correction_masks_the_sent_subspace():
    c = PowerSGD(rank=2)
    grads = [np.random.default_rng(s).standard_normal((30, 20)).astype(np.float32) for s in range(5)]
    bias = [np.random.default_rng(50 + s).standard_normal(5).astype(np.float32) for s in range(5)]
    u_bias = np.zeros(5, np.float32)
    for s, (g, b) in enumerate(zip(grads, bias)):
        approx, sent_bias = c.reduce([g, b], Context(s, 0), lambda a: a, 1, BETA)
        u_bias = np.float32(BETA) * u_bias + np.float32(1 - BETA) * b
        assert same_bits(sent_bias, u_bias)  # vectors send their velocity as it is
        u = c.velocities[(0, 0)]
        p_hat = np.linalg.svd(approx.astype(np.float64))[0][:, :2]  # approx = P^ Q^T spans P^'s columns
        # what is left of the velocity has no component in the subspace that was just sent
        assert np.abs(p_hat.T @ u).max() <= 1e-5 * np.abs(u).max()
        assert np.abs(u).max() > 0
    state = c.state()
    assert {k.split("/")[0] for k in state} == {"residual", "q", "velocity"}
    again = PowerSGD(rank=2)
    again.load_state(state)
    assert again.velocities.keys() == c.velocities.keys()
    again.load_state({})
    assert again.velocities == {} and again.residuals == {} and again.q == {}
