"""The arithmetic of owner-written checkpoints, without MPI: a dataset's CRC-32 from disjoint boxes
(hpctrain/ckpt/crc.py), a rank's flat ranges as boxes of the logical arrays (hpctrain/ckpt/boxes.py),
and who owns which range of a replicated buffer (hpctrain/ckpt/ownership.py). References: zlib.crc32
of the whole array's bytes, and tensor_parallel.shard's pieces."""

import itertools
import zlib

import numpy as np
import pytest

from hpctrain.ckpt import crc, ownership
from hpctrain.ckpt.boxes import box_from_block, slot_boxes
from hpctrain.ckpt.format import crc32_combine
from hpctrain.nn.tensor_parallel import shard


def _random_tiling(rng, shape):
    """Boxes (start, count) that tile an array of ``shape``: each axis cut at random places."""
    cuts = [sorted({0, n, *rng.integers(0, n + 1, 3).tolist()}) for n in shape]
    boxes = [([a for a, _ in box], [b - a for a, b in box])
             for box in itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts])]
    return [b for b in boxes if min(b[1]) > 0]


@pytest.mark.parametrize("shape, dtype", [((37,), np.float32), ((9, 5), np.float64), ((4, 6, 7), np.float32),
                                          ((1,), np.int64), ((3, 1), np.uint64)])
def test_the_xor_of_box_contributions_is_the_whole_arrays_zlib_crc(shape, dtype):
    rng = np.random.default_rng(len(shape) * 10 + np.dtype(dtype).itemsize)
    a = (rng.standard_normal(shape) * 1000).astype(dtype)
    for _ in range(5):
        boxes = _random_tiling(rng, shape)
        rng.shuffle(boxes)   # any order: XOR
        acc = 0
        for start, count in boxes:
            acc ^= crc.box_contribution(a[tuple(slice(s, s + c) for s, c in zip(start, count))], start, count, shape)
        assert crc.finish(acc, a.nbytes) == zlib.crc32(a.tobytes())
    if len(boxes) > 1:   # a box missing, or counted twice, gives another CRC: never silently right
        start, count = boxes[0]
        twice = acc ^ crc.box_contribution(a[tuple(slice(s, s + c) for s, c in zip(start, count))], start, count,
                                           shape)
        assert crc.finish(twice, a.nbytes) != zlib.crc32(a.tobytes())


def test_shift_and_zero_crcs_agree_with_zlib_and_the_python_combine(monkeypatch):
    rng = np.random.default_rng(3)
    for n in [1, 7, 64, 1000, 1 << 20, (1 << 33) + 5]:
        value = int(rng.integers(1, 1 << 32))
        assert crc.shift(value, n) == crc32_combine(value, 0, n)
    assert crc.zeros_crc(77) == zlib.crc32(bytes(77)) and crc.zeros_crc(0) == 0
    data = rng.bytes(1000)
    assert crc.linear(data) == zlib.crc32(data) ^ zlib.crc32(bytes(1000))
    monkeypatch.setattr(crc, "_ZLIB", None)   # without zlib's C functions: the pure Python shift, same values
    crc._operator.cache_clear()
    try:
        assert crc.shift(12345, 1 << 20) == crc32_combine(12345, 0, 1 << 20)
        a = np.arange(30, dtype=np.float32).reshape(5, 6)
        acc = crc.box_contribution(a[:, :2], (0, 0), (5, 2), a.shape) ^ crc.box_contribution(a[:, 2:], (0, 2),
                                                                                              (5, 4), a.shape)
        assert crc.finish(acc, a.nbytes) == zlib.crc32(a.tobytes())
    finally:
        crc._operator.cache_clear()


SPLITS = [((12, 18), (1, 3)), ((12, 18), (0, 1)), ((24,), (0, 3)), ((8, 12), (1, 1)), ((7, 5), None), ((9,), None)]
CASES = [(shape, split, t) for shape, split in SPLITS for t in (1, 2, 3)   # (a replicated array: one rank's)
         if split is None and t == 1 or split is not None and (shape[split[0]] // split[1]) % t == 0]


@pytest.mark.parametrize("shape, split, t", CASES)
def test_every_ranks_flat_ranges_cover_the_logical_array_once(shape, split, t):
    """Each tensor rank's piece (shard), cut into random flat ranges as ZeRO chunks and owners cut
    it: the boxes put every element of the logical array in its place exactly once."""
    rng = np.random.default_rng(t)
    full = rng.standard_normal(shape)
    got, cover = np.full(shape, np.nan), np.zeros(shape, int)
    for r in range(t):
        local = shard(full, split[0], split[1], t, r) if split else full
        flat, offset = local.reshape(-1), 100   # the slot's place in its flat buffer
        cuts = sorted({0, flat.size, *rng.integers(0, flat.size, 4).tolist()})
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            for box in slot_boxes("/x", local.shape, offset, offset + lo, offset + hi, split, t, r):
                assert box.whole == shape
                where = tuple(slice(s, s + c) for s, c in zip(box.start, box.count))
                got[where] = box_from_block(box, flat[box.lo - offset:box.hi - offset])
                cover[where] += 1
                a, b = box.rows_range(0, box.count[0])
                assert (a, b) == (box.lo, box.hi)
    np.testing.assert_array_equal(got, full)
    assert (cover == 1).all()


@pytest.mark.parametrize("n, itemsize, d", [(10, 8, 4), (3_000_000, 4, 4), (2_500_001, 8, 3), (0, 4, 2)])
def test_a_replicated_buffer_is_owned_once_in_pieces_of_at_least_the_minimum(n, itemsize, d):
    per_rotation = []
    for rotate in range(d):
        ranges = sorted(r for rank in range(d) for r in ownership.spread(n, itemsize, d, rank, rotate))
        assert [a for a, _ in ranges] == ([0] + [b for _, b in ranges[:-1]] if n else [])
        assert not ranges or ranges[-1][1] == n
        assert all((b - a) * itemsize >= ownership.MIN_PIECE_BYTES for a, b in ranges[:-1])
        assert len(ranges) <= d
        per_rotation.append([len(ownership.spread(n, itemsize, d, rank, rotate)) for rank in range(d)])
    if n and n * itemsize < ownership.MIN_PIECE_BYTES:   # one piece; the grid's places give it to different ranks
        assert len({tuple(p) for p in per_rotation}) == d
