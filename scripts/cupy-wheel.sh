#!/usr/bin/env bash
# Which CuPy wheel this machine's NVIDIA driver takes, so that train.gemm = auto runs the GEMMs on
# cuBLAS. scripts/setup.sh sources this file and calls cupy_wheel; run alone it prints the choice
# and changes nothing (`bash scripts/cupy-wheel.sh`). It reads nvidia-smi only.
#
# cupy_wheel sets
#   CUPY_WHEEL        the CuPy package for the CUDA major version the driver reports, or empty
#   CUPY_REQUIREMENT  what pip installs: CUPY_WHEEL's line in setup.cfg's extras (versions, [ctk])
#   CUPY_WHY          one line for set-up's log: what was found and what follows
# HPCTRAIN_CUPY=none skips CuPy; HPCTRAIN_CUPY=cupy-cuda12x picks it without asking nvidia-smi,
# e.g. on a login node without a GPU that builds the venv its GPU nodes use.

# Driver CUDA major version -> wheel. A CUDA 13 driver runs CUDA 12 code, and takes cupy-cuda12x
# on purpose: cupy-cuda13x needs CUDA 13 libraries from pip, and those (nvidia/cu13/lib) come first
# in the search by which numba-cuda[cu12]'s cuda-bindings load nvrtc, so they would replace the
# CUDA 12 nvrtc its kernels compile with ([ctk] would also move cuda-toolkit off numba-cuda's 12.*).
CUPY_WHEEL_FOR_MAJOR="12:cupy-cuda12x 13:cupy-cuda12x"
CUPY_SETUP_CFG="$(dirname "${BASH_SOURCE[0]}")/../setup.cfg"

cupy_wheel() {
    CUPY_WHEEL="" CUPY_REQUIREMENT="" CUPY_WHY=""
    _cupy_choose
    if [ -n "$CUPY_WHEEL" ]; then
        # the indented requirement line of an extra, e.g. "    cupy-cuda12x[ctk]>=14"
        CUPY_REQUIREMENT=$(sed -n -E "s/^[[:space:]]+(${CUPY_WHEEL}([[][^]]*[]])?[<>=!~].*)$/\1/p" \
            "$CUPY_SETUP_CFG" | sed -n 1p)
        CUPY_REQUIREMENT=${CUPY_REQUIREMENT:-$CUPY_WHEEL}
    fi
}

_cupy_choose() {
    local listing first cuda major entry
    case "${HPCTRAIN_CUPY:-}" in
        "") ;;
        none) CUPY_WHY="HPCTRAIN_CUPY=none: no CuPy"; return 0 ;;
        *)
            for entry in $CUPY_WHEEL_FOR_MAJOR; do
                if [ "${entry#*:}" = "$HPCTRAIN_CUPY" ]; then CUPY_WHEEL=$HPCTRAIN_CUPY; fi
            done
            CUPY_WHY="HPCTRAIN_CUPY=$HPCTRAIN_CUPY"
            [ -n "$CUPY_WHEEL" ] || CUPY_WHY="$CUPY_WHY is neither cupy-cuda12x nor none: no CuPy"
            return 0 ;;
    esac
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        CUPY_WHY="no nvidia-smi on PATH (no NVIDIA driver): no CuPy"
        return 0
    fi
    # "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)" per GPU; a driver that fails says why instead
    listing=$(nvidia-smi -L 2>&1) || true
    if ! grep -q '^GPU ' <<<"$listing"; then
        first=${listing%%$'\n'*}
        CUPY_WHY="nvidia-smi lists no GPU (${first:-it printed nothing}): no CuPy"
        return 0
    fi
    # the driver's CUDA version: "CUDA Version: 12.8" in nvidia-smi's banner, "CUDA Version : 12.8"
    # in nvidia-smi -q (asked only when the banner lacks it)
    cuda=$(nvidia-smi 2>/dev/null | _cupy_cuda_version || true)
    [ -n "$cuda" ] || cuda=$(nvidia-smi -q 2>/dev/null | _cupy_cuda_version || true)
    if [ -z "$cuda" ]; then
        CUPY_WHY="nvidia-smi lists a GPU but no CUDA version: no CuPy (HPCTRAIN_CUPY=cupy-cuda12x picks one)"
        return 0
    fi
    major=${cuda%%.*}
    for entry in $CUPY_WHEEL_FOR_MAJOR; do
        if [ "${entry%%:*}" = "$major" ]; then CUPY_WHEEL=${entry#*:}; fi
    done
    if [ -z "$CUPY_WHEEL" ]; then
        CUPY_WHY="the driver runs CUDA $cuda; set-up knows a CuPy wheel for CUDA 12 and 13 drivers only: no CuPy"
        return 0
    fi
    CUPY_WHY="the driver runs CUDA $cuda: $CUPY_WHEEL"
}

# The first "CUDA Version: X.Y" (any spacing around the colon) on stdin, as X.Y; reads it all.
_cupy_cuda_version() {
    sed -n -E 's/.*CUDA Version[[:space:]]*:[[:space:]]*([0-9]+\.[0-9]+).*/\1/p' | sed -n 1p
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced: print the choice
    cupy_wheel
    printf '%s\n' "$CUPY_WHEEL"
    printf 'cupy-wheel: %s%s\n' "$CUPY_WHY" "${CUPY_REQUIREMENT:+ (pip install '$CUPY_REQUIREMENT')}" >&2
fi
