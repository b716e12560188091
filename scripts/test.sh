#!/usr/bin/env bash
# The whole suite: serial pytest (two workers, with the MPI tests under mpirun -n 1 beside them,
# then the exclusive tests alone), then the MPI tests under mpirun -n 2, 3, 4,
# then (only where nvidia-smi lists a GPU) the CUDA tests on the real GPU (scripts/cuda-tests*.txt).
# CUDA kernels run on numba's simulator everywhere else (tests/conftest.py).
# Every run has a per-test timeout (setup.cfg) and an outer timeout, so a hang
# fails instead of blocking. Rank 0 prints; other ranks log to .test-logs/.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
# SLURM + munge for the slurm tests' local cluster (root + apt only; ~0.1 s when present)
bash scripts/slurm-cluster.sh install || echo "test: SLURM could not be installed; the slurm tests will be skipped"
PY=${HPCTRAIN_VENV:-.venv}/bin/python
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export PYTHONUNBUFFERED=1
rm -rf .test-logs && mkdir -p .test-logs
status=0
t0=$(date +%s)

# pytest's exit status 5 is "no test selected" (arguments that name only other tests): not a failure
ok() { local rc=$?; [ $rc = 0 ] || [ $rc = 5 ]; }

# A failed mpirun -n N phase: the tail of every rank log that names a failure.
show_failed_ranks() {
    for log in .test-logs/mpi-n"$1"-rank*.log; do
        [ -f "$log" ] && grep -qE "(FAILED|ERROR|Timeout)" "$log" && { echo "--- $log"; tail -n 40 "$log"; }
    done
}

# The serial tests on two workers (pytest-xdist), a whole module per worker (module fixtures are
# built once). The MPI tests at one rank run beside them: a single process that would leave a
# core idle in a phase of its own (its report is printed after the serial one). Those marked
# exclusive (timing-sensitive, or the local SLURM cluster) then run with nothing beside them.
# Ranks of the tests' own mpirun jobs yield the CPU while they wait (the workers' jobs share
# two cores).
echo "== serial, two workers: pytest -m 'not mpi and not exclusive' -n 2; beside it mpirun -n 1: pytest --with-mpi -m mpi"
( timeout 900 mpirun -n 1 --oversubscribe bash scripts/pytest-rank.sh 1 "$@" >.test-logs/mpi-n1-rank0.log 2>&1
  echo $? >.test-logs/mpi-n1.rc ) &
one_rank=$!
OMPI_MCA_mpi_yield_when_idle=1 timeout 1800 "$PY" -m pytest -q -m "not mpi and not exclusive" -n 2 --dist loadfile \
    --junitxml=.test-logs/serial.xml "$@"; ok || status=1
wait "$one_rank"
echo "== mpirun -n 1: pytest --with-mpi -m mpi (ran beside the serial tests)"
cat .test-logs/mpi-n1-rank0.log
[ "$(cat .test-logs/mpi-n1.rc 2>/dev/null)" = 0 ] || { status=1; show_failed_ranks 1; }
echo "== serial, alone: pytest -m 'not mpi and exclusive'"
timeout 900 "$PY" -m pytest -q -m "not mpi and exclusive" --junitxml=.test-logs/exclusive.xml "$@"; ok || status=1

for n in 2 3 4; do
    echo "== mpirun -n $n: pytest --with-mpi -m mpi"
    timeout 900 mpirun -n "$n" --oversubscribe bash scripts/pytest-rank.sh "$n" "$@" || { status=1; show_failed_ranks "$n"; }
done

# Real-GPU pass: every CUDA test again, on the GPU instead of the simulator
# (the small simulated shapes too: ragged tiles and the float rules differ).
# the lists are shared with scripts/gpu-check.sh
mapfile -t GPU_TESTS < <(grep -hv -e '^[[:space:]]*#' -e '^[[:space:]]*$' scripts/cuda-tests.txt)
mapfile -t GPU_TESTS_MPI < <(grep -hv -e '^[[:space:]]*#' -e '^[[:space:]]*$' scripts/cuda-tests-mpi.txt)
if ! { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }; then
    echo "== GPU: no GPU listed by nvidia-smi; the gpu tests ran as skips (kernels were tested on the simulator)"
elif [ ${#GPU_TESTS[@]} = 0 ] || [ ${#GPU_TESTS_MPI[@]} = 0 ]; then
    # pytest given no path would run the whole suite on the GPU
    echo "== GPU: scripts/cuda-tests.txt or cuda-tests-mpi.txt is missing or empty"
    status=1
else
    echo "== GPU: NUMBA_ENABLE_CUDASIM=0 pytest ${GPU_TESTS[*]}"
    NUMBA_ENABLE_CUDASIM=0 timeout 2400 "$PY" -m pytest -q "${GPU_TESTS[@]}" --junitxml=.test-logs/gpu.xml "$@"; ok || status=1
    echo "== GPU, 2 ranks: NUMBA_ENABLE_CUDASIM=0 mpirun -n 2 pytest --with-mpi -m mpi ${GPU_TESTS_MPI[*]}"
    NUMBA_ENABLE_CUDASIM=0 timeout 900 mpirun -n 2 bash scripts/pytest-rank.sh gpu "${GPU_TESTS_MPI[@]}" "$@" || {
        status=1
        [ -f .test-logs/mpi-ngpu-rank1.log ] && { echo "--- .test-logs/mpi-ngpu-rank1.log"; tail -n 40 .test-logs/mpi-ngpu-rank1.log; }
    }
fi

echo "== suite finished in $(( $(date +%s) - t0 )) s"
"$PY" scripts/test_summary.py .test-logs || status=1
exit $status
