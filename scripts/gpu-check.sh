#!/usr/bin/env bash
# One command that validates hpctrain on a machine with an NVIDIA GPU (docs/gpu.md):
#
#     bash scripts/gpu-check.sh OUTDIR
#     bash scripts/gpu-check.sh --simulate OUTDIR   # a dry run on numba's CUDA simulator, tiny sizes (CI)
#
# Needs only the project tree and a python3 that has numba (+ numba-cuda), mpi4py, h5py,
# pytest, pytest-mpi and, for the yardsticks, cupy and torch (no .venv, no install: PYTHONPATH=.).
# Runs, each with its own time limit, logging into OUTDIR/logs/:
#   1. every CUDA test on the GPU (NUMBA_ENABLE_CUDASIM=0; also the simulator-sized ones),
#      then the 2-rank CUDA tests under mpirun (they need pytest-mpi),
#   2. the kernel benchmark (benchmarks/kernels.py: each kernel validated, then timed
#      against the copy bandwidth and cuBLAS),
#   3. a GPT training step against PyTorch eager on the same GPU, fp32 and bf16 (benchmarks/gpu_step.py: the
#      example GPT and GPT-2 small's shape, losses validated first; tokens/s, per-op split,
#      launches per step, MFU),
#   4. MLP and GPT training on cuda at 1 and 2 ranks (2 ranks share the GPU),
#   5. the GPT against PyTorch DDP on the same GPU (benchmarks/scaling.py, weak scaling, 1 and 2 ranks),
# then writes OUTDIR/gpu-check.md and OUTDIR/gpu-check.json (scripts/gpu_report.py).
# Exit 0 when every step passed. About 5-8 minutes on one H100.
# GPU_CHECK_SKIP="gpu-tests kernels" leaves steps out (to rerun the rest after a fix).
# GPU_CHECK_BUDGET_S=N: the whole check ends within about N s (a lease of fixed length): each
# step's limit is cut to what is left, and a step with under 10 s left is recorded as 'budget'.
# --simulate: every step's plumbing on the simulator with tiny sizes and a few steps, the
# two test steps and the PyTorch comparison left out (the suite runs the CUDA tests on the
# simulator anyway; the peer needs a GPU to mean anything; gpu_step.py --simulate checks a tiny
# GPT against its float64 CPU twin instead): about 75 s of CPU time, no GPU (each simulated CUDA
# thread is interpreted Python, hence the tiny models).
set -uo pipefail
SIM=0
if [ "${1:-}" = "--simulate" ]; then SIM=1; shift; fi
OUT=${1:?usage: bash scripts/gpu-check.sh [--simulate] OUTDIR}
mkdir -p "$OUT/logs" "$OUT/runs"
OUT=$(cd "$OUT" && pwd)   # relative to where it was called from, before the cd below
cd "$(dirname "$0")/.."
# absolute: mpirun starts its ranks with its own PATH, where python3 may be another one
PY=$(command -v "${HPCTRAIN_PYTHON:-python3}")
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NUMBA_ENABLE_CUDASIM=$SIM
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
CHECK_T0=$(date +%s)
MPIRUN=${MPIRUN:-mpirun}  # Open MPI may oversubscribe through the variable above; others need no flag
DATA=$OUT/data
mkdir -p "$DATA"
: > "$OUT/steps.tsv"

# step NAME LIMIT_S CMD...: runs CMD with a time limit, logs to logs/NAME.log, records rc and seconds
step() {
    local name=$1 limit=$2
    shift 2
    local t0 rc ms
    case " ${GPU_CHECK_SKIP:-} " in *" $name "*)
        echo "== $name: skipped (GPU_CHECK_SKIP)"; printf '%s\tskipped\t0\n' "$name" >> "$OUT/steps.tsv"; return 0 ;;
    esac
    if [ -n "${GPU_CHECK_BUDGET_S:-}" ]; then
        local left=$(( GPU_CHECK_BUDGET_S - ($(date +%s) - CHECK_T0) - 10 ))  # 10 s for the report
        if [ $left -lt 10 ]; then
            echo "== $name: out of budget"; printf '%s\tbudget\t0\n' "$name" >> "$OUT/steps.tsv"; return 0
        fi
        [ $left -lt $limit ] && limit=$left
    fi
    t0=$(date +%s%N)
    echo "== $name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
    rc=$?
    ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    printf '%s\t%s\t%d.%03d\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) >> "$OUT/steps.tsv"
    echo "   rc=$rc in $((ms / 1000)) s"
    return 0
}

# sizes: the real check, or the simulator's (each simulated thread runs interpreted Python)
if [ $SIM = 1 ]; then
    GPU_CHECK_SKIP="${GPU_CHECK_SKIP:-} gpu-tests gpu-tests-mpi gpt-vs-torch"
    # no warm-up call: the simulator has no JIT to warm, and one call per row is the smoke test
    KERNELS_ARGS=(--small --repeats 1 --warmup 0)
    GPU_STEP_ARGS=(--simulate)
    # the tiny GPT's fp32 and bf16 rows, five simulated steps each (two validated, one timed, one
    # counted, one split by op): about 30 s of CPU in all
    GPU_STEP_LIMIT=420
    # 16 evaluation samples: the final evaluation is one forward (8 rows per rank at 2 ranks);
    # the simulator's softmax costs ~16 barriers per row, 128 rows took longer than training
    N_SYNTH=(512 16)
    # tiny BLAS work (the synthetic teacher); BLAS threads only spin on a shared 2-core CI machine
    export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
    # two steps, as the GPT's: the second step's loss comes after the first update, so 1 rank = 2
    # ranks compares the summed gradient and the update; a third step was one more simulated step
    # per run (~1.5-2 s each), not one more check
    MLP_SETS=(--set train.steps=2 --set train.global_batch=8 --set "model.hidden=[8]" --set train.target_accuracy=0)
    # d 4 (2 heads of 2): the block's MLP (16 wide) and qkv (12) fit one 16-deep K slab of the GEMM
    # (d 8 took two in three of a step's 15 GEMMs); context 4 halves the tokens of every step
    GPT_SETS=(--set train.steps=2 --set train.global_batch=2 --set model.n_layer=1 --set model.d_model=4
              --set model.n_head=2 --set model.context=4 --set train.eval_tokens=8)
    # python -m hpctrain with the simulator made safe for the communication thread's launches
    # beside the main thread's (the opt-in test tool hpctrain/testing; the trainer patches nothing)
    TRAIN_MODULE=hpctrain.testing
else
    TRAIN_MODULE=hpctrain
    KERNELS_ARGS=()
    GPU_STEP_ARGS=()
    GPU_STEP_LIMIT=240
    N_SYNTH=(65536 8192)
    MLP_SETS=()
    GPT_SETS=(--set train.steps=200 --set train.eval_tokens=65536)
fi
echo "simulate=$SIM" > "$OUT/mode.txt"

{ [ $SIM = 1 ] && echo "numba CUDA simulator (--simulate)"
  nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c "import sys, numba, numpy; print('python', sys.version.split()[0], 'numba', numba.__version__, 'numpy', numpy.__version__)"
  "$PY" -c "import cupy; print('cupy', cupy.__version__)" 2>&1 | tail -1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tail -1
  mpirun --version 2>&1 | head -1; nproc; } > "$OUT/env.txt" 2>&1

# the lists are shared with make test's real-GPU pass (scripts/test.sh)
mapfile -t CUDA_TESTS < <(grep -hv -e '^[[:space:]]*#' -e '^[[:space:]]*$' scripts/cuda-tests.txt)
mapfile -t CUDA_TESTS_MPI < <(grep -hv -e '^[[:space:]]*#' -e '^[[:space:]]*$' scripts/cuda-tests-mpi.txt)
if [ ${#CUDA_TESTS[@]} = 0 ] || [ ${#CUDA_TESTS_MPI[@]} = 0 ]; then
    # an empty list would make pytest run the whole suite
    echo "gpu-check: scripts/cuda-tests.txt or cuda-tests-mpi.txt is missing or empty" >&2; exit 1
fi
# -v: a test killed by the limit leaves each earlier result in the log (the XML is written at the end)
step gpu-tests 300 "$PY" -m pytest -v --durations=20 -p no:cacheprovider --junitxml="$OUT/logs/gpu-tests.xml" \
    "${CUDA_TESTS[@]}"
# the CUDA tests that need ranks (compression's device sums, the GPT and its tensor-parallel
# split on cuda against cpu), 2 ranks sharing the GPU; they need pytest-mpi (pip install
# pytest-mpi, or put it on PYTHONPATH: -p loads it without its entry point); without it the
# step fails with that message (a check that did not run them does not pass), unless
# GPU_CHECK_SKIP names the step
if [ $SIM = 0 ] && [[ " ${GPU_CHECK_SKIP:-} " != *" gpu-tests-mpi "* ]] && ! "$PY" -c "import pytest_mpi" 2>/dev/null; then
    missing="gpu-check: pytest-mpi is not importable by $PY: pip install pytest-mpi, or put its folder on \
PYTHONPATH (GPU_CHECK_SKIP=gpu-tests-mpi leaves the 2-rank CUDA tests out)"
    echo "$missing" >&2
    step gpu-tests-mpi 10 bash -c 'echo "$0"; exit 127' "$missing"
else
    step gpu-tests-mpi 240 $MPIRUN -n 2 "$PY" -m pytest -q -p no:cacheprovider -p pytest_mpi --with-mpi -m mpi \
        "${CUDA_TESTS_MPI[@]}"
fi
step kernels 180 "$PY" benchmarks/kernels.py "${KERNELS_ARGS[@]}" --json "$OUT/kernels.json"
step gpu-step "$GPU_STEP_LIMIT" "$PY" benchmarks/gpu_step.py "${GPU_STEP_ARGS[@]}" --json "$OUT/gpu_step.json"

# the data: synthetic tables, and the text corpus (the running Python's standard library);
# simulated, random tokens: a 9-token /val, two windows of 4 + 1, one per rank at 2 ranks (the
# final evaluation scores all of it in one forward; 11 windows cost more than a training step),
# and a vocabulary of 65, not 256: the tied head's GEMMs still span two 64-wide tiles (the second
# one column wide) and its input gradient four full K slabs and a ragged fifth (96 took six): the
# costliest GEMM of a step
make_data() {
    "$PY" -m hpctrain data synth --out "$DATA/synth-train.h5" --n "$1" --seed 1 &&
    "$PY" -m hpctrain data synth --out "$DATA/synth-eval.h5" --n "$2" --seed 2 || return 1
    if [ "$SIM" = 1 ]; then
        "$PY" - "$DATA/text.h5" <<'PYEOF'
import sys

import h5py
import numpy as np

r = np.random.default_rng(0)
with h5py.File(sys.argv[1], "w") as f:
    f["train"] = r.integers(0, 65, 4096).astype(np.uint16)
    f["val"] = r.integers(0, 65, 9).astype(np.uint16)
    f.attrs.update(format="hpctrain-tokens", format_version=1, vocab_size=65)
PYEOF
    else
        "$PY" -m hpctrain data text --out "$DATA/text.h5"
    fi
}
export -f make_data
export PY DATA SIM
step data 120 bash -c 'make_data "$@"' make_data "${N_SYNTH[@]}"

for n in 1 2; do
    step "mlp-cuda-$n" 120 $MPIRUN -n $n "$PY" -m $TRAIN_MODULE train --config examples/mlp.toml \
        --set train.device=cuda --set "data.train=$DATA/synth-train.h5" --set "data.eval=$DATA/synth-eval.h5" \
        --set "checkpoint.dir=$OUT/runs/mlp$n" --set "train.metrics=$OUT/runs/mlp-$n.jsonl" "${MLP_SETS[@]}"
    # the example GPT, shortened (its accuracy target is for the whole run: not checked here)
    step "gpt-cuda-$n" 180 $MPIRUN -n $n "$PY" -m $TRAIN_MODULE train --config examples/gpt.toml \
        --set train.device=cuda --set "data.train=$DATA/text.h5" --set train.eval_every=0 \
        --set train.target_bpb_vs_bigram=0 --set "checkpoint.dir=$OUT/runs/gpt$n" \
        --set "train.metrics=$OUT/runs/gpt-$n.jsonl" "${GPT_SETS[@]}"
done

# a GPT that gives the GPU work (6 layers, d 384, 6 heads of 64, context 256; 16 windows per rank),
# hpctrain and PyTorch DDP from the same weights on the same data, losses compared first
step gpt-vs-torch 300 "$PY" benchmarks/scaling.py --device cuda --models gpu=gpt:6-384-6-256 --ranks 1 2 \
    --modes weak --peer-models gpu --ceiling-models "" --trace-config "" --steps 40 --warmup 10 \
    --text "$DATA/text.h5" --out "$OUT/scaling"

"$PY" scripts/gpu_report.py "$OUT"
