"""Every CUDA kernel compiles for a real GPU (sm_90 PTX), even where there is none.

The simulator tests check what kernels compute; this checks that numba's CUDA
compiler accepts them, which the simulator never asks.
"""

import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.timeout(300)


SHARDS = 2   # CI's two cores: pytest runs one test at a time, so the second would sit idle


def test_every_kernel_compiles_to_ptx_for_sm90(tmp_path):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=REPO)
    logs = [(tmp_path / f"shard{i}.out", tmp_path / f"shard{i}.err") for i in range(SHARDS)]
    procs = []
    try:
        for i, (out, err) in enumerate(logs):   # files, not pipes: a full pipe would stall a shard
            with open(out, "w") as fo, open(err, "w") as fe:
                procs.append(subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "ptx_compile.py"),
                                               "--shard", f"{i}/{SHARDS}"], cwd=REPO, env=env, stdout=fo,
                                              stderr=fe))
        for proc in procs:
            proc.wait(timeout=240)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    stdout = "".join(out.read_text() for out, _ in logs)
    stderr = "".join(err.read_text() for _, err in logs)
    assert [p.returncode for p in procs] == [0] * SHARDS, stdout[-4000:] + stderr[-4000:]
    # 2 dtypes x (12 GEMMs (3 tilings x 4 transpose pairs) + 6 bias_act (backward with its column
    # sums) + 3 softmax (rows, backward, fused) + sgd + adamw + lamb's direction + scale + all_finite
    # + sum_squares) + row sums + 4 precision conversions
    # + 22 compression kernels (2 dtypes x 8, cast f64->f32, lowrank_residual, sparse_take, pack_ef,
    # sample_abs, compact)
    # + 61 attention variants (tests/ptx_attention.py: each dtype, head-size capacity and fitting tile)
    # + 6 kernels of the GEMM attention (2 dtypes x softmax rows, probs, grad rows)
    # + 25 embedding / layernorm (with the fused residual add; the parameter gradients' partial and
    # final sums one kernel) / residual kernels (tests/ptx_gpt_ops.py)
    assert stdout.count("\nok ") == 2 * 27 + 1 + 4 + 22 + 61 + 6 + 25, stdout
