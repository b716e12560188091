"""benchmarks/gpu_step.py off the GPU: a step whose losses disagree with the reference is not
timed and fails the run; the datasheet peaks are looked up by the card's name. Its whole
--simulate run (validated, timed, counted, split by op) is tests/test_gpu_check.py's dry run."""

import importlib.util
import json
import os

import pytest

from conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_step", os.path.join(REPO, "benchmarks", "gpu_step.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="the --simulate path: the simulator")
def test_a_shape_whose_losses_disagree_is_not_timed_and_the_run_fails(tmp_path, capsys):
    """A tolerance of 0: float32 on the simulated GPU never equals the float64 CPU twin exactly,
    so validation must fail, and then nothing is timed."""
    out = tmp_path / "gpu_step.json"
    assert _bench().main(["--simulate", "--validate", "1", "--loss-rtol", "0", "--precisions", "fp32",
                          "--json", str(out)]) == 1
    (row,) = json.loads(out.read_text())["rows"]
    assert row["valid"] is False and row["loss_rel_diff"] > 0 and "ms_per_step" not in row
    printed = capsys.readouterr().out
    assert "tiny fp32: FAILED validation" in printed and "| tiny | fp32 | 16 | NO vs hpctrain float64 CPU" in printed


def test_the_datasheet_peak_is_found_by_the_cards_name():
    bench = _bench()
    assert bench.card_peak_tflops("NVIDIA H100 80GB HBM3") == 67.0
    assert bench.card_peak_tflops("NVIDIA H100 PCIe") == 51.0
    assert bench.card_peak_tflops("NVIDIA H200") == 67.0
    assert bench.card_peak_tflops("Tesla T4") is None
