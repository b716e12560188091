#!/usr/bin/env bash
# Prepare everything hpctrain needs, idempotently: system MPI + parallel HDF5
# (root with apt only), a .venv, mpi4py and h5py built against the MPI in use,
# and CuPy where nvidia-smi lists a GPU (cuBLAS for the GEMMs; scripts/cupy-wheel.sh).
#
# Two paths:
#   * root on Debian/Ubuntu: apt installs Open MPI and libhdf5-openmpi-dev.
#   * a cluster without root: nothing is installed system-wide; MPI comes from
#     `module load` (the mpicc on PATH) and parallel HDF5 from HDF5_DIR, or from
#     the prefix of the h5pcc on PATH.
# When already set up (stamp matches) it returns in well under a second.
#
# Environment knobs:
#   HPCTRAIN_VENV=path            where the venv lives (default .venv)
#   HPCTRAIN_MPI4PY_FROM_SOURCE=1 build mpi4py with the mpicc on PATH instead
#                                 of trying PyPI's binary wheel first
#   HDF5_DIR=prefix               parallel HDF5 install to build h5py against
#   PYTHON=python3.11             interpreter to make the venv from
#   HPCTRAIN_CUPY=none|cupy-cuda12x  skip CuPy, or install it without a GPU here
#                                 (a login node building the venv of GPU nodes)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${HPCTRAIN_VENV:-.venv}
PYTHON=${PYTHON:-python3}
H5PY_VERSION=3.16.0
STAMP="$VENV/.hpctrain-setup"
HDF5_DIR_ASKED=${HDF5_DIR:-}  # as given by the user; detection below may fill HDF5_DIR

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: ERROR: %s\n' "$*" >&2; exit 1; }
warn() { printf 'setup: WARNING: %s\n' "$*" >&2; }

# The CuPy wheel this machine's driver takes (none without a GPU): asked once, before the stamp
# check, so that a machine that gains a GPU (or changes driver) re-runs the slow part.
# shellcheck source=scripts/cupy-wheel.sh
. scripts/cupy-wheel.sh
cupy_wheel  # sets CUPY_WHEEL, CUPY_REQUIREMENT, CUPY_WHY

# The stamp covers what set-up depends on; any change re-runs the slow part.
fingerprint() {
    {
        cat scripts/setup.sh scripts/cupy-wheel.sh setup.cfg
        command -v mpicc h5pcc || true
        "$PYTHON" -c 'import sys; print(sys.version)' 2>/dev/null || true
        printf '%s\n' "$HDF5_DIR_ASKED" "${HPCTRAIN_MPI4PY_FROM_SOURCE:-}" "cupy=$CUPY_REQUIREMENT"
    } | sha256sum | cut -d' ' -f1
}

if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(fingerprint)" ]; then
    exit 0  # already set up
fi

t0=$(date +%s)

# ---- system packages (root + apt only) ---------------------------------------
APT_PKGS="openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools pkg-config python3-venv python3-dev make"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=""
    for p in $APT_PKGS; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"
    done
    if [ -n "$missing" ]; then
        say "installing system packages:$missing"
        export DEBIAN_FRONTEND=noninteractive
        apt-get -o DPkg::Lock::Timeout=600 update -qq
        # shellcheck disable=SC2086
        apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends $missing >/dev/null
    else
        say "system packages present"
    fi
else
    say "not root or no apt-get: skipping system packages (using MPI/HDF5 from the environment, e.g. 'module load')"
fi

command -v mpicc >/dev/null || die "no mpicc on PATH. Load your MPI first (e.g. 'module load openmpi') or run as root on Debian/Ubuntu so setup can install Open MPI."
command -v mpirun >/dev/null || command -v srun >/dev/null || die "neither mpirun nor srun on PATH; load your MPI module."
MPICC=$(command -v mpicc)
say "mpicc: $MPICC ($( (mpicc --version 2>/dev/null || true) | head -n1))"

# ---- parallel HDF5 -------------------------------------------------------------
# Order: HDF5_DIR, then a module's h5pcc on PATH, then Debian's packaged
# parallel HDF5 (Debian's own /usr/bin/h5pcc does not give a usable prefix).
h5pcc=$(command -v h5pcc || true)
if [ -z "${HDF5_DIR:-}" ] && [ -n "$h5pcc" ] && [ "$(dirname "$h5pcc")" != /usr/bin ]; then
    HDF5_DIR=$(dirname "$(dirname "$h5pcc")")
fi
if [ -z "${HDF5_DIR:-}" ]; then
    multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
    for cand in "/usr/lib/$multiarch/hdf5/openmpi" "/usr/lib/$multiarch/hdf5/mpich"; do
        if grep -qs 'define H5_HAVE_PARALLEL 1' "$cand/include/H5pubconf.h"; then
            HDF5_DIR=$cand; break
        fi
    done
fi
[ -n "${HDF5_DIR:-}" ] || die "no parallel HDF5 found. Set HDF5_DIR to its prefix, or 'module load' one that provides h5pcc."
grep -qs 'define H5_HAVE_PARALLEL 1' "$HDF5_DIR/include/H5pubconf.h" \
    || die "HDF5 at $HDF5_DIR is not built with MPI (H5_HAVE_PARALLEL missing in include/H5pubconf.h)."
say "parallel HDF5: $HDF5_DIR"

# ---- virtual environment ---------------------------------------------------------
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
    || die "$PYTHON is older than 3.11 (or missing); hpctrain needs Python >= 3.11 (tomllib). Set PYTHON=python3.11."
want_py=$("$PYTHON" -c 'import sys; print(sys.version)')
if [ -x "$VENV/bin/python" ] && [ "$("$VENV/bin/python" -c 'import sys; print(sys.version)')" != "$want_py" ]; then
    say "$VENV was made with another Python; recreating it"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV" || die "'$PYTHON -m venv' failed; install python3-venv or set PYTHON."
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# numba-cuda[cu12]: the CUDA target and simulator, plus pip's CUDA 12 NVVM and
# nvrtc (~430 MB), so kernels compile with no system toolkit, GPU or not.
"${PIP[@]}" install "numpy>=1.26,<2.6" "numba>=0.60,<0.69" "numba-cuda[cu12]>=0.20,<0.31" Cython pkgconfig "setuptools>=77" packaging wheel \
    "pytest>=8" "pytest-mpi>=0.6" "pytest-timeout>=2.3" "pytest-xdist>=3.5" "hypothesis>=6" "isal>=1.6,<2" \
    "greenlet>=3"

# mpi4py and h5py are tied to the MPI and HDF5 they were built against: when
# either changed since the last set-up, rebuild both.
BUILD_ID="mpicc=$MPICC hdf5=$HDF5_DIR from_source=${HPCTRAIN_MPI4PY_FROM_SOURCE:-}"
if [ -f "$VENV/.hpctrain-build" ] && [ "$(cat "$VENV/.hpctrain-build")" != "$BUILD_ID" ]; then
    say "MPI or HDF5 changed since the last set-up; rebuilding mpi4py and h5py"
    "${PIP[@]}" uninstall -y mpi4py h5py >/dev/null 2>&1 || true
fi

# ---- mpi4py: PyPI's binary wheel loads the system libmpi; fall back to a build ----
mpi4py_ok() { "$PY" -c 'from mpi4py import MPI; MPI.Get_library_version()' >/dev/null 2>&1; }
if ! mpi4py_ok; then
    if [ -z "${HPCTRAIN_MPI4PY_FROM_SOURCE:-}" ]; then
        say "mpi4py: trying the binary wheel"
        "${PIP[@]}" install "mpi4py>=4.1,<4.2" || true
    fi
    if ! mpi4py_ok; then
        say "mpi4py: building from source with $MPICC (~2.5 min)"
        "${PIP[@]}" uninstall -y mpi4py >/dev/null 2>&1 || true
        CC=$MPICC MPICC=$MPICC "${PIP[@]}" install --no-binary=mpi4py --no-cache-dir "mpi4py>=4.1,<4.2"
    fi
fi
mpi4py_ok || die "mpi4py cannot load the MPI library."
say "mpi4py: $("$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().rstrip(chr(0)).splitlines()[0].strip())')"

# ---- h5py against parallel HDF5 (never PyPI's serial wheel) ------------------------
h5py_mpi() { "$PY" -c 'import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)' >/dev/null 2>&1; }
# The wheel we build is kept outside the clone, under a key of everything it was built against
# (h5py version, Python, MPI compiler, the HDF5 library file), so a fresh clone on a machine that
# built one installs it in seconds. pip's own cache is not used: it could hand back a serial wheel.
WHEELS=${HPCTRAIN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpctrain/wheels}
hdf5_lib=$(readlink -f "$HDF5_DIR/lib/libhdf5.so" 2>/dev/null || readlink -f "$HDF5_DIR/libhdf5.so" 2>/dev/null || true)
h5py_key=$(printf '%s\n' "$H5PY_VERSION" "$want_py" "$("$MPICC" -show 2>/dev/null)" "$hdf5_lib" \
    "$(stat -c '%s %Y' "$hdf5_lib" 2>/dev/null)" | sha256sum | cut -c1-16)
h5py_wheels="$WHEELS/h5py-$h5py_key"
if ! h5py_mpi && compgen -G "$h5py_wheels/h5py-*.whl" >/dev/null; then
    say "h5py: installing the wheel built here before ($h5py_wheels)"
    "${PIP[@]}" uninstall -y h5py >/dev/null 2>&1 || true
    "${PIP[@]}" install --no-deps "$h5py_wheels"/h5py-*.whl || true
    h5py_mpi || { say "h5py: that wheel does not load with MPI; building again"; rm -rf "$h5py_wheels"; }
fi
if ! h5py_mpi; then
    say "h5py: building $H5PY_VERSION against $HDF5_DIR with MPI (~2-3 min)"
    "${PIP[@]}" uninstall -y h5py >/dev/null 2>&1 || true
    # No build isolation: isolation compiles its own mpi4py inside the build (>12 min, >20 GB).
    rm -rf "$h5py_wheels.tmp" && mkdir -p "$h5py_wheels.tmp"
    CC=$MPICC HDF5_MPI=ON HDF5_DIR=$HDF5_DIR \
        "${PIP[@]}" wheel --no-deps --no-binary=h5py --no-build-isolation --no-cache-dir -w "$h5py_wheels.tmp" \
        "h5py==$H5PY_VERSION"
    "${PIP[@]}" install --no-deps "$h5py_wheels.tmp"/h5py-*.whl
    if h5py_mpi; then rm -rf "$h5py_wheels" && mv "$h5py_wheels.tmp" "$h5py_wheels"; else rm -rf "$h5py_wheels.tmp"; fi
fi
h5py_mpi || die "h5py was installed without MPI support (h5py.get_config().mpi is False)."
say "h5py: $("$PY" -c 'import h5py; print(h5py.__version__, "HDF5", h5py.version.hdf5_version, "mpi=True")')"

# ---- hpctrain itself (editable, so `python -m hpctrain` works from any directory) --
"${PIP[@]}" install --no-deps --no-build-isolation -e .

# ---- CuPy where nvidia-smi lists a GPU: train.gemm = auto then runs the GEMMs on cuBLAS ----
# Never fatal: without CuPy the numba GEMM kernels run (0.21-0.34x cuBLAS on an H100), and the
# run says so at start-up. On a GPU the check multiplies through cuBLAS, as the trainer does.
say "CuPy: $CUPY_WHY"
if [ -n "$CUPY_WHEEL" ]; then
    # with a GPU: a product through cuBLAS; chosen by HPCTRAIN_CUPY (maybe no GPU here): the import
    cupy_check='import sys; from hpctrain.kernels.support.cublas import cupy_status; ok, why = cupy_status(); print(why); sys.exit(not ok)'
    [ -z "${HPCTRAIN_CUPY:-}" ] || cupy_check='import cupy'
    cupy_failed=""
    if ! "${PIP[@]}" install "$CUPY_REQUIREMENT"; then
        cupy_failed="pip install '$CUPY_REQUIREMENT' failed (above)"
    elif ! cupy_why=$("$PY" -c "$cupy_check" 2>&1); then
        cupy_failed="CuPy installed but does not work: ${cupy_why##*$'\n'}"  # the exception's line
    fi
    if [ -n "$cupy_failed" ]; then
        warn "$cupy_failed; GEMMs on the GPU will use the slower numba kernels (train.gemm = auto). To fix: fix the cause, then $PY -m pip install '$CUPY_REQUIREMENT'"
    else
        say "CuPy: $("$PY" -c 'import cupy; print(cupy.__version__)') (cuBLAS for train.gemm = auto)"
    fi
fi

printf '%s\n' "$BUILD_ID" >"$VENV/.hpctrain-build"
fingerprint >"$STAMP"
say "ready in $(( $(date +%s) - t0 )) s ($VENV)"
