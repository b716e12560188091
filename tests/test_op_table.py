"""The op table (hpctrain/device/ops.py): each op's CPU twin and CUDA launcher follow the kernels'
one layout and naming scheme (hpctrain/kernels/__init__.py), and the CPU table holds the twins
themselves.
"""

from __future__ import annotations

from hpctrain.device import CPU_OPS
from hpctrain.device.ops import CUBLAS_GEMMS, OPS


def test_every_op_is_a_twin_and_its_cuda_launcher_from_one_op_module():
    """kernels/<op>.py (or the op's folder) holds the twin ``name`` and its launcher ``name_cuda``;
    the kernels themselves are in a ``..._cuda`` module beside it."""
    for name, op in OPS.items():
        assert op.cuda.__name__ == op.cpu.__name__ + "_cuda", name
        twin, launcher = op.cpu.__module__, op.cuda.__module__
        assert twin.startswith("hpctrain.kernels.") and not twin.endswith("_cuda"), (name, twin)
        assert launcher.startswith("hpctrain.kernels.") and not launcher.endswith("_cuda"), (name, launcher)
        assert twin.split(".")[2] == launcher.split(".")[2], (name, twin, launcher)   # one op (file or folder)
    for name, launcher in CUBLAS_GEMMS.items():
        assert launcher.__name__ == OPS[name].cuda.__name__ + "_cublas", name


def test_gpt_ops_are_in_the_cpu_kernel_table():
    import importlib

    for op in ("embedding", "layernorm", "attention", "residual"):
        module = importlib.import_module(f"hpctrain.kernels.{op}")
        for half in ("forward", "backward"):
            name = f"{op}_{half}"
            assert getattr(CPU_OPS, name) is getattr(module, name)  # the twin itself, not something callable
