#!/usr/bin/env bash
# One rank of `mpirun -n N bash scripts/pytest-rank.sh NAME [pytest args]`: NAME names the run's
# files, .test-logs/mpi-nNAME-rankR.{xml,log} (the rank count N, or gpu for the real-GPU pass);
# rank 0 reports on the terminal, the others into .test-logs/ (shown on failure).
n=$1; shift
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-0}}}
args=(-m pytest -q --with-mpi -m mpi --junitxml=".test-logs/mpi-n$n-rank$rank.xml" "$@")
if [ "$rank" = 0 ]; then
    exec "${HPCTRAIN_VENV:-.venv}/bin/python" "${args[@]}"
else
    exec "${HPCTRAIN_VENV:-.venv}/bin/python" "${args[@]}" >".test-logs/mpi-n$n-rank$rank.log" 2>&1
fi
