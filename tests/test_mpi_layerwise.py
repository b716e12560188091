"""LAMB and LARS when a parameter's norm is spread over ranks (run under mpirun -n 1..4): ZeRO-1 and
ZeRO-2 shares (each rank holds part of a parameter), tensor-parallel splits (each tensor rank a
piece) and pipeline stages (each stage its own parameters, the tied table on two) train like the
same world without them, in float64. The partial sums of squares are added in another order than
one rank adds them (per share, then across ranks), so the parameters agree to rtol 1e-10, not bit
for bit. The update rules themselves are checked against NumPy in tests/test_layerwise.py."""

import numpy as np
import pytest

from hpctrain.training.config import Config
from whole_model import start, train, whole as _whole

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def _config(data, optim, steps=3, zero=0, t=1, p=1, ckpt_dir="/tmp/hpctrain-unused", resume=""):
    cfg = Config()
    cfg.model.kind = "gpt"
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = 2, 4, 16, 16
    cfg.data.train, cfg.train.eval_tokens = data, 256
    cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.02, 0.01  # several buckets: parameters cut by ZeRO chunks
    cfg.dist.allreduce, cfg.dist.zero, cfg.dist.tensor_parallel, cfg.dist.pipeline_parallel = "ring", zero, t, p
    cfg.train.global_batch, cfg.train.grad_accum_steps, cfg.train.steps = 16, 2, steps
    cfg.train.dtype, cfg.train.log_every = "float64", 10**6
    cfg.optim.name, cfg.optim.warmup_steps, cfg.optim.weight_decay = optim, 2, 0.1
    cfg.optim.lr = 2.0 if optim == "lars" else 1e-2
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.keep_last = ckpt_dir, resume, 0
    cfg.checkpoint.every_minutes, cfg.checkpoint.save_final = 0, ckpt_dir != "/tmp/hpctrain-unused"
    return cfg.validate()






@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


def _initial(world, data, optim):
    """The run's starting weights (a trainer built, no step run)."""
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    return _whole(Trainer(_config(data, optim), world, Log(False)))


LAYOUTS = [dict(zero=1), dict(zero=2), dict(t=2), dict(p=2)]


@pytest.mark.parametrize("optim", ["lamb", "lars"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_spread_parameters_take_the_whole_parameters_trust_ratio(world, mpi_text_data, optim, layout):
    need = layout.get("t", 1) * layout.get("p", 1)
    if world.size % need or (layout.get("zero") and world.size < 2):
        pytest.skip(f"needs a multiple of {need} ranks" if world.size % need else "ZeRO shares need 2 ranks")
    spread = train(_config(mpi_text_data, optim, **layout), world)[0]
    whole = train(_config(mpi_text_data, optim), world)[0]
    got, want = _whole(spread), _whole(whole)
    start = _initial(world, mpi_text_data, optim)
    moved = 0
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-14, err_msg=name)
        moved += not np.allclose(want[name], start[name])
    assert moved > len(want) // 2   # the runs trained
    ratios = whole.optimizer.ratios
    assert np.any(ratios != 1.0) and np.any(ratios == 1.0)   # scaled matrices, unscaled biases and norms
    if "zero" not in layout:
        for state, buf in spread.optimizer.state().items():
            got_s, want_s = _whole(spread, buf), _whole(whole, whole.optimizer.state()[state])
            for name in want_s:
                np.testing.assert_allclose(got_s[name], want_s[name], rtol=1e-9, atol=1e-14, err_msg=f"{state} {name}")


def test_a_lamb_checkpoint_resumes_at_another_zero_stage(world, mpi_text_data):
    """LAMB's moments and step count saved under ZeRO-1 at step 2, resumed with zero 0 to step 4: the
    parameters equal an uninterrupted zero 0 run's (rtol 1e-10)."""
    from conftest import fresh_shared_dir

    if world.size < 2:
        pytest.skip("ZeRO shares need 2 ranks")
    d = fresh_shared_dir(world, "lamb-resume")
    train(_config(mpi_text_data, "lamb", steps=2, zero=1, ckpt_dir=d), world)
    resumed = start(_config(mpi_text_data, "lamb", steps=4, ckpt_dir=d, resume="auto"), world)
    assert resumed.step == 2 and resumed.optimizer.t == 2   # resumed from the ZeRO-1 save of step 2
    resumed.run()
    straight = train(_config(mpi_text_data, "lamb", steps=4), world)[0]
    got, want = _whole(resumed), _whole(straight)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-14, err_msg=name)
