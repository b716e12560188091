"""hpctrain/ckpt/compress_state.py's restore rules, on a stand-in run (compressor, config, world size): at the saved world
size each rank takes its own row; at another world size, scope "all" and no tensor
parallelism, every rank takes the mean row (so the mean over ranks, what the update still
owes, is kept); in every other case the state starts from zero and the log says why.
tests/test_mpi_compress_resize.py runs the same through real checkpoints and mpirun."""

import io
from types import SimpleNamespace

import numpy as np

from hpctrain.ckpt.compress_state import restore_compression
from hpctrain.observe.log import Log


class Compression:
    """Keeps what load_state was given, as the real compressors' load_state does."""

    def __init__(self):
        self.loaded = None

    def load_state(self, state):
        self.loaded = {k: np.array(v, np.float32) for k, v in state.items()}


def trainer(size, scope="all", t=1, compress="powersgd(2)", momentum=True, k=1):
    dist = SimpleNamespace(compress=compress, compress_scope=scope, tensor_parallel=t, compress_momentum=momentum)
    return SimpleNamespace(compression=Compression(), world=SimpleNamespace(size=size),
                           cfg=SimpleNamespace(dist=dist, train=SimpleNamespace(grad_accum_steps=k)))


SAVED = ("powersgd(2)", "all", 1, True)


def rows(seed=0):
    """Three saved ranks' state: a residual (5,), PowerSGD's Q (4, 2), identical on every rank."""
    r = np.random.default_rng(seed)
    q = r.standard_normal((4, 2)).astype(np.float32)
    return [{"residual/0/0": r.standard_normal(5).astype(np.float32), "q/0/0": q} for _ in range(3)]


def across(saved):
    """What the reader gives at another world size: mean rows (float64) and the lengths whole."""
    keys = sorted(saved[0])
    out = {f"/compress/{k}": np.mean([np.float64(s[k]) for s in saved], axis=0) for k in keys}
    out["/compress/lengths"] = np.array([[s[k].size for k in keys] for s in saved], np.int64)
    return out


def restored(t, saved, own=None, saved_compress=SAVED):
    out = io.StringIO()
    restore_compression(t.compression, t.cfg, t.world.size, own or {}, len(saved), saved_compress, Log(True, out), across(saved))
    return t.compression.loaded, out.getvalue()


def test_same_world_size_takes_its_own_row():
    saved = rows()
    t = trainer(3)
    own = {f"/compress/{k}": v for k, v in saved[1].items()}
    own["/compress/lengths"] = np.array([2 * 4, 5], np.int64)   # keys sorted: q/0/0, residual/0/0
    restore_compression(t.compression, t.cfg, t.world.size, own, 3, SAVED, Log(False), {})
    assert sorted(t.compression.loaded) == ["q/0/0", "residual/0/0"]
    for k, v in saved[1].items():
        assert np.array_equal(t.compression.loaded[k], v)


def test_another_world_size_takes_the_mean_and_keeps_what_is_owed():
    saved = rows()
    for size in (1, 2, 5):
        got, log = restored(trainer(size), saved)
        assert "mean of the 3 saved ranks'" in log
        # every new rank holds the mean, so the mean over the new ranks is the saved ranks' mean
        want = np.mean([np.float64(s["residual/0/0"]) for s in saved], axis=0)
        np.testing.assert_array_max_ulp(got["residual/0/0"], want.astype(np.float32), maxulp=0)
        assert np.abs(np.float64(got["residual/0/0"]) - want).max() <= 2 ** -24 * np.abs(want).max()
        assert np.array_equal(got["q/0/0"], saved[0]["q/0/0"])   # the same Q on every rank: its mean is itself
        assert not np.array_equal(got["residual/0/0"], saved[0]["residual/0/0"])   # not merely rank 0's row


def test_another_grad_accum_steps_rescales_residuals_and_velocities_not_q():
    """Residuals are sums of k micro-batches' gradients, scaled by 1 / (N k) after the all-reduce:
    at k = 3 from a save at k = 2 they (and velocities) are 3/2 of the saved ones; Q is a basis."""
    saved = rows()
    saved[0]["velocity/1"] = saved[1]["velocity/1"] = saved[2]["velocity/1"] = np.full(3, 0.5, np.float32)
    got, log = restored(trainer(2, k=3), saved, saved_compress=SAVED + (2,))
    want = np.mean([np.float64(s["residual/0/0"]) for s in saved], axis=0) * 1.5
    np.testing.assert_array_equal(got["residual/0/0"], want.astype(np.float32))
    np.testing.assert_array_equal(got["velocity/1"], np.full(3, 0.75, np.float32))
    assert np.array_equal(got["q/0/0"], saved[0]["q/0/0"]) and "scaled by 1.5" in log
    # at the saved world size too, and a file from before the setting was stored counts as k = 1
    t = trainer(3, k=2)
    own = {f"/compress/{k}": v for k, v in saved[1].items()}
    restore_compression(t.compression, t.cfg, t.world.size, own, 3, SAVED, Log(False), {})
    np.testing.assert_array_equal(t.compression.loaded["residual/0/0"], saved[1]["residual/0/0"] * 2)
    assert np.array_equal(t.compression.loaded["q/0/0"], saved[1]["q/0/0"])


def test_state_starts_from_zero_where_no_mean_means_anything():
    saved = rows()
    cases = {"compress_scope = 'inter'": trainer(2, scope="inter"),
             "tensor parallelism": trainer(2, t=2)}
    for why, t in cases.items():
        got, log = restored(t, saved, saved_compress=(t.cfg.dist.compress, t.cfg.dist.compress_scope,
                                                       t.cfg.dist.tensor_parallel, True))
        assert got == {} and "not restored" in log and why in log, log
    # another compressor, or momentum correction turned off: the state means something else
    for t in (trainer(4, compress="topk(0.01)"), trainer(2, momentum=False)):
        got, log = restored(t, saved)
        assert got == {} and "not restored" in log and "(compress, scope, tensor_parallel, momentum)" in log
    # a saved rank without a key (or padded): not the whole buckets scope all keeps
    short = rows()
    t = trainer(2)
    out = io.StringIO()
    ranks = across(short)
    ranks["/compress/lengths"][2, 1] = 0
    restore_compression(t.compression, t.cfg, t.world.size, {}, 3, SAVED, Log(True, out), ranks)
    assert t.compression.loaded == {} and "differ in length" in out.getvalue()


def test_a_file_without_compressor_state_resets_it():
    t = trainer(2)
    restore_compression(t.compression, t.cfg, t.world.size, {}, 3, SAVED, Log(False), {})
    assert t.compression.loaded == {}


def test_another_bucket_layout_starts_from_zero_and_says_so():
    """The rows are per bucket, in its element order: saved under another layout (or by a version
    that did not record one) they would meet other parameters, so nothing is restored."""
    saved = rows()
    t = trainer(3)
    t.compression.layout = "abc"
    own = {f"/compress/{k}": v for k, v in saved[1].items()}
    for layout in ("def", ""):
        out = io.StringIO()
        restore_compression(t.compression, t.cfg, 3, own, 3, SAVED + (1, layout), Log(True, out), {})
        assert t.compression.loaded == {} and "another bucket layout" in out.getvalue()
    restore_compression(t.compression, t.cfg, 3, own, 3, SAVED + (1, "abc"), Log(False), {})
    assert set(t.compression.loaded) == set(saved[1])
