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
