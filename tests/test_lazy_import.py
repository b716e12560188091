"""kernels/support/lazy_import.py: a module imported at its first use, once, from any thread; and a
run on the CPU that never imports numba.cuda."""

import os
import subprocess
import sys
import threading

from conftest import REPO
from hpctrain.kernels.support.lazy_import import lazy_import

SLOW_MODULE = """
import sys, time
IMPORTS = getattr(sys, "_lazy_import_test_count", 0) + 1
sys._lazy_import_test_count = IMPORTS
time.sleep(0.3)   # a wide window for a second thread's first use
SELF = sys.modules[__name__]
VALUE = 42
"""


def test_imports_at_first_use_once_even_from_two_threads(tmp_path, monkeypatch):
    (tmp_path / "slow_for_lazy_test.py").write_text(SLOW_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delattr(sys, "_lazy_import_test_count", raising=False)
    proxy = lazy_import("slow_for_lazy_test")
    assert "slow_for_lazy_test" not in sys.modules and "not imported yet" in repr(proxy)
    seen = []
    threads = [threading.Thread(target=lambda: seen.append((proxy.VALUE, proxy.SELF))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    import slow_for_lazy_test

    assert seen == [(42, slow_for_lazy_test)] * 2 and slow_for_lazy_test.IMPORTS == 1
    proxy.VALUE = 7    # a write reaches the module (a test's monkeypatch through the stand-in)
    assert slow_for_lazy_test.VALUE == 7 and "imported" in repr(proxy)
    monkeypatch.delitem(sys.modules, "slow_for_lazy_test")


def test_a_cpu_run_never_imports_numba_cuda(tmp_path):
    """Every op file's launchers reach numba.cuda lazily: training on the CPU (here a GPT step
    and an MLP step, each with compression, which imports the CUDA compressors' module) leaves it
    unimported; a launch on the simulator imports it."""
    script = """
import sys
from hpctrain.training.config import Config
from hpctrain.training.trainer import Trainer
from hpctrain.observe.log import Log
from hpctrain.runtime import init_world
from hpctrain.data.synth import write_synthetic
from hpctrain.data.text import write_token_file
world = init_world()
write_synthetic(sys.argv[1] + "/d.h5", 256, 8, 4, seed=1)
write_token_file(sys.argv[1] + "/t.h5", [sys.argv[2] + "/hpctrain/kernels/support"], val_percent=20)
for kind in ("mlp", "gpt"):
    cfg = Config()
    cfg.model.kind = kind
    cfg.train.device, cfg.train.steps, cfg.train.global_batch, cfg.train.eval_every = "cpu", 1, 8, 0
    cfg.dist.compress = "topk(0.5)"
    cfg.checkpoint.dir, cfg.checkpoint.save_final = sys.argv[1] + "/ck-" + kind, False
    if kind == "gpt":
        cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = 1, 1, 8, 8
        cfg.data.train = sys.argv[1] + "/t.h5"
    else:
        cfg.data.train, cfg.data.eval = sys.argv[1] + "/d.h5", ""
    trainer = Trainer(cfg.validate(), world, Log(False))
    trainer.run()
    trainer.close(0)
assert "numba.cuda" not in sys.modules, "a CPU run imported numba.cuda"
from hpctrain.kernels import scale
import numpy as np
scale.scale_cuda(np.ones(4, np.float32), 2.0)   # a launch (on the simulator)
assert "numba.cuda" in sys.modules
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=REPO, NUMBA_ENABLE_CUDASIM="1")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path), REPO], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]
