"""The auto strategy's model: alpha-beta lines between probe sizes, chosen per size."""

from hpctrain.comm import auto


def _auto_with(times):
    a = object.__new__(auto.AutoAllreduce)   # the model alone, no MPI measurement
    a.names = list(times)
    a.fits = {n: auto._segments(auto.PROBE_BYTES, t) for n, t in times.items()}
    return a


def test_segments_pass_through_every_measurement():
    t = [1e-4, 2e-4, 1e-3, 8e-3, 3e-2]
    segs = auto._segments(auto.PROBE_BYTES, t)
    for (alpha, beta), n, want in zip(segs, auto.PROBE_BYTES, t):
        assert abs(alpha + beta * n - want) <= 1e-12
    alpha, beta = segs[-1]
    assert abs(alpha + beta * auto.PROBE_BYTES[-1] - t[-1]) <= 1e-12


def test_choice_follows_the_measurements_across_an_algorithm_switch():
    # "lat" wins small messages, "bw" wins large ones; the crossover is inside
    # the 64 KB - 1 MB segment. One line over all sizes would blur this.
    times = {"lat": [1e-5, 5e-5, 8e-4, 7e-3, 3e-2], "bw": [1e-4, 1.5e-4, 4e-4, 2e-3, 7e-3]}
    a = _auto_with(times)
    assert a.choose(4 << 10) == "lat" and a.choose(64 << 10) == "lat"
    assert a.choose(1 << 20) == "bw" and a.choose(256 << 20) == "bw"   # beyond the last probe: last segment
    assert a.choose(0) == "lat"                                         # below the first: first segment


def test_a_falling_segment_never_predicts_negative_time():
    a = _auto_with({"noisy": [1e-4, 5e-5, 1e-3, 1e-3, 9e-4], "steady": [2e-4, 2e-4, 2e-3, 1e-2, 4e-2]})
    alpha, beta = a.fits["noisy"][-1]
    assert alpha >= 0 and beta > 0


def test_a_window_slice_chooses_among_the_zero_copy_fits_and_a_plain_array_among_the_others():
    # shm copying a plain array in and out is slow; on its own window it is the fastest here
    times = {"mpi": [1e-5, 5e-5, 5e-4, 4e-3, 2e-2], "shm": [3e-5, 1e-4, 9e-4, 8e-3, 3e-2],
             auto.ZERO_COPY: [2e-5, 4e-5, 3e-4, 2e-3, 8e-3]}
    a = _auto_with(times)
    assert a.choose(4 << 10) == "mpi" and a.choose(4 << 10, zero_copy=True) == "mpi"
    assert a.choose(1 << 20, zero_copy=True) == auto.ZERO_COPY
    assert a.choose(1 << 20) == "mpi"   # never zero-copy for a buffer outside the window ...
    a.fits["shm"] = auto._segments(auto.PROBE_BYTES, [1e-5, 1e-5, 1e-5, 1e-5, 1e-5])
    assert a.choose(1 << 20) == "shm" and a.choose(1 << 20, zero_copy=True) == auto.ZERO_COPY  # ... nor copy in it


def _fits(x):
    return {"ring": [(x, 1e-9)] * 4}


def test_the_cache_keeps_one_entry_per_layout(tmp_path):
    """Jobs of several sizes share one cache file: each finds its own entry, a size's new
    measurement replaces only its own, and a file of one entry (older versions) still reads."""
    path = str(tmp_path / "auto.json")
    k4, k2 = {"size": 4, "n_nodes": 2}, {"size": 2, "n_nodes": 1}
    auto._save(path, k4, _fits(1.0))
    auto._save(path, k2, _fits(2.0))
    assert auto._load(path, k4) == _fits(1.0) and auto._load(path, k2) == _fits(2.0)
    auto._save(path, k2, _fits(3.0))
    assert auto._load(path, k4) == _fits(1.0) and auto._load(path, k2) == _fits(3.0)
    assert auto._load(path, {"size": 8}) is None
    import json

    with open(path, "w") as fh:
        json.dump({"key": k4, "fits": _fits(5.0)}, fh)
    assert auto._load(path, k4) == _fits(5.0)
    with open(path, "w") as fh:
        fh.write("{not json")
    assert auto._load(path, k4) is None  # measured again; the next save rewrites the file
    auto._save(path, k2, _fits(6.0))
    assert auto._load(path, k2) == _fits(6.0)


def test_concurrent_writers_lose_no_entry(tmp_path):
    """Eight processes, each saving its own layout's entry into the same file twenty times."""
    import multiprocessing

    path = str(tmp_path / "auto.json")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_save_many, args=(path, i)) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for i in range(8):
        assert auto._load(path, {"size": i}) == _fits(19.0)


def _save_many(path, i):
    for n in range(20):
        auto._save(path, {"size": i}, _fits(float(n)))


def test_a_checkpoint_gives_back_its_choices_only_at_its_layout():
    a = _auto_with({"ring": [1e-5, 2e-5, 1e-4, 1e-3, 1e-2], "rhd": [2e-5, 3e-5, 2e-4, 2e-3, 2e-2]})
    a.key, a._picked = {"size": 4}, {}
    saved = a.choices()
    assert a.choose(1 << 20) == "ring"
    other = dict(saved, fits={"ring": saved["fits"]["rhd"], "rhd": saved["fits"]["ring"]})  # rhd wins there
    assert a.restore_choices(other) and a.choose(1 << 20) == "rhd"
    assert not a.restore_choices(dict(saved, key={"size": 2})) and a.choose(1 << 20) == "rhd"
    assert not a.restore_choices(None)
