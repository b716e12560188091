"""Past the 32-bit counts (mpirun -n 2 only): an array of more than 2^31 elements, a rank whose share
is more than 2 GiB, written by its owner and read back by another rank whole and by a third box that
straddles element 2^31 -- the selections, pieces, MPI-IO calls, memory files and CRC lengths all past
what an int holds. A float16 array (parameters are floating point): 4.3 GB on disk and about 10 GB of
memory over both ranks."""

import os

import numpy as np
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.timeout(600)]

BIG = 2**31 + 77         # float16 elements: > 2^31 elements, 4 GiB
CHUNK = 1 << 26


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


def _bits(lo: int, hi: int) -> np.ndarray:
    """Elements [lo, hi) of the big array, as its uint16 bit patterns: a function of the index with
    no short period (a piece written at a wrong offset shows), computable chunk by chunk."""
    i = np.arange(lo, hi, dtype=np.int64)
    return ((i * 40503 + (i >> 16) * 7 + (i >> 31)) & 0xFFFF).astype(np.uint16)


def _big() -> np.ndarray:
    out = np.empty(BIG, np.uint16)
    for lo in range(0, BIG, CHUNK):
        out[lo:lo + CHUNK] = _bits(lo, min(BIG, lo + CHUNK))
    return out.view(np.float16)


def _available_bytes() -> int:
    with open("/proc/meminfo") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))


def test_an_array_past_2_to_the_31_elements_saves_and_loads(world):
    if world.size != 2:
        pytest.skip("runs at 2 ranks: one writes the 2 GiB share, the other reads it (more ranks add memory, "
                    "not cases)")
    from mpi4py import MPI

    if world.comm.allreduce(_available_bytes(), op=MPI.MIN) < 12 << 30:
        pytest.skip("needs 12 GiB of free memory (4 GiB and a 1 GiB piece on one rank, 4 GiB on the other)")
    from conftest import fresh_shared_dir

    from hpctrain.ckpt import write
    from hpctrain.ckpt.read import load_checkpoint, verify_file
    from hpctrain.ckpt.state import Entry

    small = np.arange(10, dtype=np.float32) * (world.rank + 1)   # rank 1's (what it writes is its own)
    big = _big() if world.rank == 0 else None

    def never(lo, hi):  # pragma: no cover - owner-written entries are not cut into row ranges
        raise AssertionError("owner-written entries are not read by rows")

    entries = [Entry("/model/big/weight", (BIG,), np.dtype(np.float16), never,
                     pieces=[((0,), (BIG,), lambda a, b: big[a:b])] if world.rank == 0 else []),
               Entry("/model/small/bias", small.shape, small.dtype, never,
                     pieces=[((0,), small.shape, lambda a, b: small[a:b])] if world.rank == 1 else [])]
    directory = fresh_shared_dir(world, "large")
    path = write.write_checkpoint(directory, 1, entries, {"epoch": 0}, world)
    assert os.path.getsize(path) > BIG

    # the other way round: rank 1 needs (and owns, so checks) the big array whole, rank 0 the small one
    # and a box of the big one across element 2^31 that it does not own
    cross = (BIG - 2000, 2000)   # elements 2^31 - 1923 .. 2^31 + 76
    request = ([("/model/small/bias", (0,), small.shape, True, small.shape),
                ("/model/big/weight", (cross[0],), (cross[1],), False, (BIG,))] if world.rank == 0 else
               [("/model/small/bias", (0,), (0,), True, small.shape),   # every rank asks for every dataset
                ("/model/big/weight", (0,), (BIG,), True, (BIG,))])
    loaded = load_checkpoint(path, world, request)
    assert not loaded.unfit and loaded.shapes["/model/big/weight"] == (BIG,)
    if world.rank == 0:
        np.testing.assert_array_equal(loaded.boxes[0], np.arange(10, dtype=np.float32) * 2)
        np.testing.assert_array_equal(loaded.boxes[1].view(np.uint16), _bits(cross[0], cross[0] + cross[1]))
        del big
        verify_file(path)
    else:
        got = loaded.boxes[1]
        assert got.shape == (BIG,) and got.dtype == np.float16
        bits = got.view(np.uint16)
        wrong = [lo for lo in range(0, BIG, CHUNK) if not np.array_equal(bits[lo:lo + CHUNK],
                                                                         _bits(lo, min(BIG, lo + CHUNK)))]
        assert not wrong, f"elements from {wrong[:3]} differ"
    world.comm.Barrier()
