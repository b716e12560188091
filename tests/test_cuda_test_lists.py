"""scripts/cuda-tests.txt and cuda-tests-mpi.txt: the CUDA tests that must also run on a real
GPU, read by both make test's real-GPU pass (scripts/test.sh) and scripts/gpu-check.sh. CI has
no GPU, so a stale entry or a new CUDA test module left off the lists would otherwise go
unnoticed until a GPU session: each entry must name an existing module (and test), and every
CUDA test module must be listed, the MPI ones in the MPI list."""

import os
import re

from conftest import REPO

LISTS = {"single": "scripts/cuda-tests.txt", "mpi": "scripts/cuda-tests-mpi.txt"}
# a compile check (PTX for sm_90, no GPU needed), not a test of what kernels compute; and this file
NOT_CUDA_RUNS = {"tests/test_cuda_compile.py", "tests/test_cuda_test_lists.py"}


def entries(name):
    with open(os.path.join(REPO, LISTS[name])) as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def test_each_entry_names_an_existing_test_once():
    for name in LISTS:
        listed = entries(name)
        assert len(listed) == len(set(listed)), f"{LISTS[name]} lists an entry twice"
        for entry in listed:
            path, _, test = entry.partition("::")
            assert os.path.isfile(os.path.join(REPO, path)), f"{LISTS[name]}: no file {path}"
            if test:
                with open(os.path.join(REPO, path)) as f:
                    assert re.search(rf"^def {re.escape(test)}\(", f.read(), re.M), f"{LISTS[name]}: no test {entry}"
            assert os.path.basename(path).startswith("test_mpi_") == (name == "mpi"), \
                f"{entry}: MPI test modules go in cuda-tests-mpi.txt, the others in cuda-tests.txt"


def test_every_cuda_test_module_is_listed():
    listed = {e.partition("::")[0] for name in LISTS for e in entries(name)}
    tests = os.path.join(REPO, "tests")
    for module in sorted(os.listdir(tests)):
        if not (module.startswith("test_") and module.endswith(".py")):
            continue
        rel = f"tests/{module}"
        with open(os.path.join(tests, module)) as f:
            marked_gpu = "pytest.mark.gpu" in f.read()
        if ("cuda" in module or marked_gpu) and rel not in NOT_CUDA_RUNS:
            assert rel in listed, f"{rel} runs CUDA kernels but is in neither scripts/cuda-tests*.txt"


def test_both_scripts_read_the_lists():
    for script in ("scripts/test.sh", "scripts/gpu-check.sh"):
        with open(os.path.join(REPO, script)) as f:
            text = f.read()
        for path in LISTS.values():
            assert path in text, f"{script} does not read {path}"
        assert "tests/test_cuda_kernels.py" not in text, f"{script} lists CUDA tests of its own"
