"""The benchmarks run and validate (smoke tests at tiny sizes; their numbers are
not checked here: performance targets belong to the benchmarks themselves).
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_kernel_benchmark_validates_every_kernel_on_the_simulator(tmp_path):
    out = tmp_path / "kernels.json"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    # one call per row, timed, and no warm-up call (the simulator has no JIT to warm): the numbers
    # are not checked here, and the GPT step's simulated calls take seconds each
    proc = subprocess.run([sys.executable, "benchmarks/kernels.py", "--small", "--repeats", "1", "--warmup", "0",
                           "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout and "simulator" in proc.stdout
    doc = json.loads(out.read_text())
    text = json.dumps(doc)
    for kernel in ("gemm_nn", "gemm_tn", "gemm_nt", "bias_act_forward", "bias_act_backward",
                   "softmax_xent_forward", "softmax_xent_backward", "softmax_xent_fused", "sgd_step", "adamw_step", "scale",
                   "layernorm_forward", "layernorm_backward", "attention_forward", "attention_backward",
                   "attention_forward (gemm)", "attention_backward (+forward) (gemm)", "gpt_step"):
        assert kernel in text, kernel
    assert all(doc["validation"].values()), doc["validation"]
    assert doc["repeats"] == 1 and all("median_ms" in r for r in doc["rows"]), doc["rows"]  # every row timed


def test_kernel_benchmark_without_gpu_or_simulator_exits_2():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "benchmarks/kernels.py"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_train_throughput_cuda_without_gpu_is_one_clear_error():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "--device", "cuda", "--ranks", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no GPU is usable" in proc.stdout + proc.stderr


# alone: twice in CI, beside the other worker's jobs, one of its mpirun jobs exited 1 without a line
# of output (not reproduced alone, nor beside this module's other tests); cause not found yet
@pytest.mark.exclusive
def test_memory_benchmark_validates_and_accounts_per_rank(text_data, tmp_path):
    """A tiny GPT at 2 ranks, six ways: the runs must end alike (the benchmark checks), zero 1, 2 and 3
    halve the optimizer state at 2 ranks, recompute shrinks activations, and part 2 finds a model."""
    config = tmp_path / "tiny.toml"
    config.write_text('[model]\nkind = "gpt"\nn_layer = 3\nn_head = 2\nd_model = 32\ncontext = 32\n'
                      '[train]\nglobal_batch = 8\ndtype = "float32"\n[optim]\nname = "adamw"\n'
                      '[dist]\nbucket_mb = 0.02\nfirst_bucket_mb = 0.01\n')
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, "benchmarks/memory.py", "--config", str(config), "--text", text_data,
                           "--ranks", "2", "--steps", "4", "--skip", "1", "--repeats", "1", "--budget-gb", "0.02",
                           "--bucket-mb", "0.01", "--variants", "0:none,1:none,2:none,3:none,0:blocks,2:blocks",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = {(r["ranks"], r["zero"], r["recompute"]): r for r in result["runs"]}
    assert len(runs) == 6
    assert abs(runs[(2, 1, "none")]["optimizer_vs_zero0"] - 0.5) < 1e-3
    assert abs(runs[(2, 2, "none")]["optimizer_vs_zero0"] - 0.5) < 1e-3
    assert abs(runs[(2, 3, "none")]["optimizer_vs_zero0"] - 0.5) < 1e-3
    assert runs[(2, 0, "blocks")]["activations_vs_none"] < 1.0
    assert all(r["peak_rss_mb"] > 0 and r["step_ms"] > 0 for r in result["runs"])
    assert all(t is not None and t["bytes_per_rank"] <= 0.02e9 for t in result["largest"])
    assert "| 2 | 1 | none |" in proc.stdout and "| 2 | 2 | blocks |" in proc.stdout and "Targets:" in proc.stdout
    assert "zero 2 gradients at 2 rank(s)" in proc.stdout and "zero 3 at 2 rank(s)" in proc.stdout
    assert {t["zero"] for t in result["largest"]} == {0, 1, 2, 3}
    # part 3, offload counted for a CUDA device: the state leaves the device for the host, nothing else
    off = {(r["zero"], r["offload"]): r for r in result["offload"]}
    assert len(off) == 8
    for z in range(4):
        kept, moved = off[z, "none"], off[z, "optimizer"]
        assert moved["optimizer"] == 0 and moved["host_state"] == kept["optimizer"] > 0
        assert (moved["params"], moved["grads"]) == (kept["params"], kept["grads"])


@pytest.mark.parametrize("variants, why", [("1:none,0:blocks", "the first must be 0:none"),
                                           ("0:none,0:all", "is not ZERO:RECOMPUTE")])
def test_memory_benchmark_refuses_variants_without_its_yardstick(variants, why):
    proc = subprocess.run([sys.executable, "benchmarks/memory.py", "--variants", variants], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and why in proc.stderr, proc.stderr


def test_memory_benchmark_refuses_zero_3_with_size_buckets():
    proc = subprocess.run([sys.executable, "benchmarks/memory.py", "--variants", "0:none,3:none", "--bucket-split",
                           "size"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "zero 3 gathers layer buckets" in proc.stderr, proc.stderr


def test_pipeline_sweep_reports_each_configuration_by_its_median_run():
    """--repeats R gives R runs per configuration: the row is the run of median step time, its bubble
    the median of the runs' bubbles (the range kept); a failed run is the configuration's row."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from scaling_pipeline import median_row, predicted_idle, table

    def run(ms, bubble, rc=0):
        return {"model": "gpt", "ranks": 2, "p": 2, "data_parallel": 1, "schedule": "1f1b", "micro_batches": 16,
                "rc": rc, "step_ms": ms, "tokens_per_s": 1.0, "idle_per_stage": [0.1, bubble], "idle_predicted": [],
                "bubble_measured": bubble, "bubble_formula": 1 / 17, "imbalance": 0.05,
                "activation_bytes_per_stage": [], "p2p_bytes_per_step": 1.0, "allreduce_bytes_per_step": 0,
                "link_bytes_run": None}

    row = median_row([run(600.0, 0.071), run(560.0, 0.060), run(580.0, 0.062)])
    assert row["step_ms"] == 580.0 and row["bubble_runs"] == [0.071, 0.060, 0.062] and row["runs"] == 3
    assert row["bubble_measured"] == pytest.approx(0.062)
    assert "0.062 [0.060-0.071]" in table([row])
    assert median_row([run(600.0, 0.07), run(None, None, rc=1)])["rc"] == 1
    # equal stages idle as the formula; a slower last stage idles the first stage more
    assert predicted_idle([4.0, 4.0], 4) == pytest.approx([1 / 5, 1 / 5])
    first, last = predicted_idle([4.0, 4.4], 4)
    assert first > 1 / 5 > last


def test_checkpoint_training_benchmark_measures_a_run_and_writes_its_json(text_data, tmp_path):
    """One rank, a tiny GPT: the save, load, stall and bandwidth figures are all measured and written
    (their targets are the benchmark's business, not this test's)."""
    out = tmp_path / "ckpt.json"
    proc = subprocess.run([sys.executable, "benchmarks/checkpoint_training.py", "--layout", "zero1", "--load-layout",
                           "zero0", "--n-layer", "1", "--d-model", "64", "--context", "16", "--steps", "4", "--every",
                           "2", "--text", text_data, "--dir", str(tmp_path / "runs"), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["ranks"] == 1 and got["ranks_bytes"][0]["writes"] > 0 and got["t_save"] > 0 and got["t_raw"] > 0
    assert got["stall_sync"] > 0 and got["stall_async"] > 0 and got["step_overlap"] > 0
    assert "save memory:" in proc.stdout and "bandwidth:" in proc.stdout, proc.stdout


def test_a_save_moves_no_state_between_ranks_as_open_mpi_counts_it(text_data, tmp_path):
    """Two ranks under Open MPI's message monitoring: a ZeRO-1 save sends less than 1 % of the bytes it
    writes (names and CRCs), while an all-gather of those bytes, counted the same way, moves them all
    (the count sees large messages)."""
    import shutil

    info = subprocess.run(["ompi_info"], capture_output=True, text=True).stdout if shutil.which("ompi_info") else ""
    if "pml: monitoring" not in info.replace("MCA ", ""):
        pytest.skip("needs Open MPI with its pml monitoring component (ompi_info lists it)")
    out = tmp_path / "moved.json"
    proc = subprocess.run([sys.executable, "benchmarks/checkpoint_moved.py", "--ranks", "2", "--layouts", "zero1",
                           "--n-layer", "1", "--d-model", "64", "--text", text_data, "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    assert 0 < row["moved"] < 0.01 * row["written"], row
    assert row["gather"] >= row["written"], row
