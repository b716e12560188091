"""scripts/cuda-tests.txt and cuda-tests-mpi.txt: the CUDA tests that must also run on a real
GPU, read by both make test's real-GPU pass (scripts/test.sh) and scripts/gpu-check.sh. CI has
no GPU, so a stale entry or a new CUDA test left off the lists would otherwise go unnoticed
until a GPU session: each entry must name an existing module (and test), and every test that
touches the CUDA device must be listed (its module, or the test itself), the MPI ones in the
MPI list, or be exempt below with its reason."""

import ast
import os
import re

from conftest import REPO

LISTS = {"single": "scripts/cuda-tests.txt", "mpi": "scripts/cuda-tests-mpi.txt"}
# what marks a test as using the CUDA device: the device class, the 'cuda' device name, the
# float64/float32 CUDA device fixtures of conftest, or the gpu mark (also as a module's alias, @gpu)
CUDA_USE = re.compile(r'CudaDevice|["\']cuda["\']|device=cuda|\bdev(?:32|64)\b|pytest\.mark\.gpu|@gpu\b')
EXEMPT = {
    "tests/test_cuda_compile.py": "a compile check (PTX for sm_90); it needs no GPU and runs everywhere",
    "tests/test_cuda_test_lists.py": "this file",
    "tests/test_benchmarks.py::test_train_throughput_cuda_without_gpu_is_one_clear_error": "hides every GPU",
    "tests/test_cli.py::test_cuda_device_without_a_gpu": "hides every GPU",
    "tests/test_config.py::test_zero_3_and_offload_run_in_16_bits":
        "loads a config naming train.device = cuda (offload's check); makes no CUDA device",
    "tests/test_mpi_zero.py::test_info_refuses_the_head_size_a_cuda_run_refuses":
        "plans train.device = cuda on the memory planner's stand-in device; makes no CUDA device",
    "tests/test_transfers.py::test_a_zero_3_gather_waits_for_its_slots_event_and_copies_on_the_threads_stream":
        "a stand-in device named cuda with recording streams; makes no CUDA device (the simulator's and a "
        "GPU's case is tests/test_mpi_gpt_cuda.py's, listed)",
    "tests/test_transfers.py::test_staging_copies_a_fenced_bucket_on_the_threads_stream":
        "a stand-in device named cuda with recording streams; makes no CUDA device (the real-stream "
        "case is tests/test_cuda_device.py's, listed)",
}


def entries(name):
    """The list's entries, as the scripts read them (grep drops comments and blank lines only)."""
    with open(os.path.join(REPO, LISTS[name])) as f:
        return [line.rstrip("\n") for line in f if line.strip() and not line.lstrip().startswith("#")]


def test_each_entry_names_an_existing_test_once():
    for name in LISTS:
        listed = entries(name)
        assert listed, f"{LISTS[name]} lists nothing: pytest would run the whole suite on the GPU"
        assert len(listed) == len(set(listed)), f"{LISTS[name]} lists an entry twice"
        for entry in listed:
            assert entry == entry.strip(), f"{LISTS[name]}: {entry!r} has spaces around it (or a CR)"
            path, _, test = entry.partition("::")
            assert os.path.isfile(os.path.join(REPO, path)), f"{LISTS[name]}: no file {path}"
            if test:
                with open(os.path.join(REPO, path)) as f:
                    assert re.search(rf"^def {re.escape(test.split('[')[0])}\(", f.read(), re.M), \
                        f"{LISTS[name]}: no test {entry}"
            assert os.path.basename(path).startswith("test_mpi_") == (name == "mpi"), \
                f"{entry}: MPI test modules go in cuda-tests-mpi.txt, the others in cuda-tests.txt"


def cuda_tests(path):
    """(whole module, [test names]) that use the CUDA device in the test module at ``path``."""
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source)
    whole = any(isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
                and CUDA_USE.search(ast.get_source_segment(source, node)) for node in tree.body)
    names = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            text = "\n".join("@" + ast.get_source_segment(source, d) for d in node.decorator_list)
            if CUDA_USE.search(text + "\n" + ast.get_source_segment(source, node)):
                names.append(node.name)
    return whole, names


def test_every_cuda_test_is_listed():
    listed = {e.split("[")[0] for name in LISTS for e in entries(name)}
    missing = []
    for module in sorted(os.listdir(os.path.join(REPO, "tests"))):
        rel = f"tests/{module}"
        if not (module.startswith("test_") and module.endswith(".py")) or rel in EXEMPT or rel in listed:
            continue
        whole, names = cuda_tests(os.path.join(REPO, rel))
        if whole:
            missing.append(rel)
        missing += [f"{rel}::{n}" for n in names if f"{rel}::{n}" not in listed and f"{rel}::{n}" not in EXEMPT]
    assert not missing, f"these use the CUDA device but are in neither scripts/cuda-tests*.txt: {missing}"


def test_the_detector_sees_a_cuda_test(tmp_path):
    """The check above is only as good as cuda_tests(): it must find each way a test uses CUDA."""
    sample = tmp_path / "test_sample.py"
    sample.write_text('import pytest\n\n\ndef test_host():\n    assert 1\n\n\n'
                      'def test_device():\n    dev = CudaDevice("float32")\n\n\n'
                      '@pytest.mark.parametrize("device", ["cpu", "cuda"])\ndef test_both(device):\n    pass\n\n\n'
                      'def test_fixture(dev64):\n    pass\n\n\n'
                      'gpu = pytest.mark.gpu\n\n\n@gpu\ndef test_big():\n    pass\n')
    assert cuda_tests(str(sample)) == (False, ["test_device", "test_both", "test_fixture", "test_big"])
    sample.write_text('import pytest\n\npytestmark = pytest.mark.gpu\n')
    assert cuda_tests(str(sample)) == (True, [])


def test_both_scripts_read_the_lists():
    for script in ("scripts/test.sh", "scripts/gpu-check.sh"):
        with open(os.path.join(REPO, script)) as f:
            code = [line for line in f if not line.lstrip().startswith("#")]
        for path in LISTS.values():
            assert any(path in line and "mapfile" in line for line in code), f"{script} does not read {path}"
        assert not any("tests/test_cuda_kernels.py" in line for line in code), f"{script} lists CUDA tests of its own"
