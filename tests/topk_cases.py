"""Adversarial inputs for top-k selection, shared by the host and device tests.

Each case is built to take one road of the threshold search
(hpctrain/kernels/topk_threshold.py): ``ROADS[name]`` = (fallback, passes),
passes None where it is not fixed; other cases find their candidates on the
first pass (or need none: k >= n).
"""

import numpy as np


def adversarial(name, n):
    r = np.random.default_rng([79, n])
    x = r.standard_normal(n).astype(np.float32)
    if name == "ties":                     # every magnitude ~5 times, both signs: ties at the k-th
        x = (r.integers(-1000, 1001, n) * 0.25).astype(np.float32)
    elif name == "all_equal":              # ties beyond any threshold's reach: the host fallback
        x = np.full(n, -1.25, np.float32)
    elif name == "one_huge":
        x[n // 2 + 1] = 1e30
    elif name == "many_zeros":             # fewer non-zeros than k: zeros must be picked by index
        x[:] = 0
        x[::500] = r.standard_normal(x[::500].size)
        x[3::7] = -0.0
    elif name == "nan_inf":
        x[[5, 9, 400]] = [np.nan, -np.inf, np.nan]
    elif name == "unsampled_tail":         # the sampled positions (stride 3) hold all the mass:
        x *= np.float32(1e-3)              # too few pass, a lower threshold
        x[::3] = r.standard_normal(x[::3].size)
    elif name == "sampled_small":          # the sampled positions are 0.7x the rest: too many
        x[::3] *= np.float32(0.7)          # pass (893 > 556), a higher threshold finds 438
    elif name == "sampled_tiny":           # 0.3x: too many on every pass, then the fallback
        x[::3] *= np.float32(0.3)
    return x


TOPK_CASES = [("normal", 5000, 0.01), ("normal", 7, 0.3), ("normal", 1, 0.5), ("normal", 50, 1.0),
              ("ties", 5000, 0.01), ("all_equal", 5000, 0.01), ("one_huge", 5000, 0.0002),
              ("many_zeros", 5000, 0.01), ("nan_inf", 5000, 0.01), ("unsampled_tail", 3 * 4096 + 1, 0.01),
              ("sampled_small", 3 * 4096 + 1, 0.01), ("sampled_tiny", 3 * 4096 + 1, 0.01)]

ROADS = {"all_equal": (True, None), "many_zeros": (True, None), "unsampled_tail": (False, 2),
         "sampled_small": (False, 2), "sampled_tiny": (True, 4)}


def expected_road(name, n, k):
    """(fallback, passes) the search must take for case ``name``."""
    return ROADS.get(name, (False, 1 if k < n else 0))
