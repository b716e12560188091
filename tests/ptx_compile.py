"""Compile every CUDA kernel to PTX for a real GPU, without one (run by
test_cuda_compile.py in a fresh process with NUMBA_ENABLE_CUDASIM=0).

The simulator runs kernels as Python, so it accepts code numba's CUDA compiler
rejects (a shared-array shape that is not a compile-time constant, say). NVVM
from pip (numba-cuda[cu12]) compiles without a driver; only device functions
ask the driver for the current GPU's compute capability, so that question is
answered here with the target's.

When pip's ptxas is present (nvidia-cuda-nvcc-cu12, part of numba-cuda[cu12]),
each PTX is also assembled for sm_90 and its registers, shared memory and
spills are printed; a spilling GEMM or attention kernel fails (its accumulators
belong in registers), and so does a float32 build of an elementwise kernel with
float64 arithmetic in it (FLOAT32_ONLY).

Prints one line per kernel; exit status 1 if any failed. ``--shard I/N`` compiles only the
kernels whose index is I modulo N, so N processes share the work (test_cuda_compile.py runs two:
the serial suite leaves the second core idle, and NVVM and ptxas are single-threaded).
"""

import glob
import os
import re
import subprocess
import sys
import tempfile
import types as pytypes

import numba.cuda.dispatcher as dispatcher
from numba import cuda
from numba.types import Array, boolean, float32, float64, int64

CC = (9, 0)  # sm_90: H100 / H200
dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=CC)

from hpctrain.kernels import (adamw, adamw_cuda, bias_act, ef_cuda, finite_cuda, gather_scatter_cuda, lamb,  # noqa: E402
                              lamb_cuda, linear_cuda, lowp, lowp_cuda, quantize16, quantize16_cuda, scale_cuda, sgd,
                              sgd_cuda, sign_pack, sign_pack_cuda, softmax_xent_cuda, sum_squares_cuda,
                              topk_threshold_cuda)
from numba.types import int32, uint8, uint16, uint32  # noqa: E402

import ptx_attention  # noqa: E402 - beside this file: the GPT's attention kernels
import ptx_gpt_ops  # noqa: E402 - beside this file: the GPT's embedding, layernorm and residual kernels


def arr(dtype, ndim):
    return Array(dtype, ndim, "C")


def kernels():
    """(name, kernel, argument types, must the PTX be free of local memory)."""
    for dt in (float32, float64):
        m, v = arr(dt, 2), arr(dt, 1)
        for tile in linear_cuda.TILES:
            for ta in (False, True):
                for tb in (False, True):
                    # the per-thread accumulators must live in registers, not local memory
                    yield f"gemm {tile} TA={ta:d} TB={tb:d} {dt}", linear_cuda.gemm_kernel(ta, tb, dt.name, tile), \
                        (m, m, m, boolean), True
        for act in ("identity", "relu", "gelu"):
            fwd, bwd = bias_act.cuda_kernels(act, dt.name)
            yield f"bias_act forward {act} {dt}", fwd, (m, v, m), False
            yield f"bias_act backward {act} {dt}", bwd, (m, m, m, arr(float64, 2), arr(int32, 1), v, boolean), False
        f64 = arr(float64, 1)
        yield f"softmax_xent rows {dt}", softmax_xent_cuda.rows_kernel(dt.name, False), \
            (m, arr(int64, 1), dt, m, f64, f64), False
        yield f"softmax_xent backward {dt}", softmax_xent_cuda.softmax_xent_backward_kernel, \
            (m, arr(int64, 1), dt, m), False
        yield f"softmax_xent fused {dt}", softmax_xent_cuda.rows_kernel(dt.name, True), \
            (m, arr(int64, 1), dt, m, f64, f64), False
        yield f"sgd {dt}", sgd_cuda.sgd_update_kernel(sgd._update), (v,) * 4 + (boolean,), False
        yield f"adamw {dt}", adamw_cuda.adamw_update_kernel(adamw._update), (v,) * 5 + (boolean,), False
        yield f"lamb direction {dt}", lamb_cuda.lamb_direction_kernel(lamb._direction), (v,) * 6, False
        yield f"scale {dt}", scale_cuda.scale_kernel, (v, dt), False
        yield f"all_finite {dt}", finite_cuda.nonfinite_kernel, (v, arr(int32, 1)), False
        yield f"sum_squares {dt}", sum_squares_cuda.sum_squares_kernel, (v, arr(float64, 1)), False
    yield "softmax_xent row sums", softmax_xent_cuda.sum_rows_kernel, (arr(float64, 1),) * 3 + (boolean,), False
    # train.precision's conversions, on the bits (uint32 <-> uint16)
    u32, u16 = arr(uint32, 1), arr(uint16, 1)
    yield "narrow bf16", lowp_cuda.conversion_kernel(lowp._f32_to_bf16), (u32, u16), False
    yield "widen bf16", lowp_cuda.conversion_kernel(lowp._bf16_to_f32), (u16, u32), False
    yield "narrow fp16", lowp_cuda.conversion_kernel(lowp._f32_to_fp16), (u32, u16), False
    yield "widen fp16", lowp_cuda.conversion_kernel(lowp._fp16_to_f32), (u16, u32), False
    yield from compression_kernels()
    yield from ptx_attention.kernels()
    yield from ptx_gpt_ops.kernels()


def compression_kernels():
    """The gradient compressors' kernels (hpctrain/compress/device.py): float32 residuals and
    payloads, buckets (x, out) of either dtype."""
    f32 = arr(float32, 1)
    for dt in (float32, float64):
        bucket = arr(dt, 1)
        yield f"quantize16 encode_ef {dt}", quantize16_cuda.quantize16_kernels(quantize16._element_functions)[0], (bucket, f32, arr(uint16, 1), int64), False
        yield f"quantize16 decode -> {dt}", quantize16_cuda.quantize16_kernels(quantize16._element_functions)[1], (arr(uint16, 1), bucket, int64), False
        yield f"ef_correct {dt}", ef_cuda.ef_correct_kernel, (bucket, f32), False
        yield f"cast_copy float32 -> {dt}", ef_cuda.cast_copy_kernel, (f32, bucket), False
        if dt is float64:
            yield "cast_copy float64 -> float32", ef_cuda.cast_copy_kernel, (bucket, f32), False
        yield f"fill {dt}", ef_cuda.fill_kernel, (bucket, dt), False
        yield f"sparse_scatter -> {dt}", gather_scatter_cuda.sparse_scatter_kernel, (bucket, arr(int32, 1), f32, boolean), \
            False
        yield f"sign chunk_scales_ef {dt}", sign_pack_cuda.chunk_scales_ef_kernel(sign_pack.SUM_THREADS), (bucket, f32, int64, f32), False
        yield f"sign unpack_sum -> {dt}", sign_pack_cuda.unpack_sum_kernel, \
            (arr(uint8, 2), arr(float32, 2), int64, bucket), False
    yield "lowrank_residual", ef_cuda.lowrank_residual_kernel, (f32, f32, float32), False
    yield "sparse_take", gather_scatter_cuda.sparse_take_kernel, (f32, arr(int32, 1), f32), False
    yield "sign pack_ef", sign_pack_cuda.pack_ef_kernel, (f32, f32, int64, arr(uint8, 1)), False
    yield "topk sample_abs", topk_threshold_cuda.sample_abs_kernel, (f32, int64, f32), False
    yield "topk threshold_compact", topk_threshold_cuda.threshold_compact_kernel, \
        (f32, float32, arr(int32, 1), f32, arr(int32, 1)), False


# Kernels whose float32 build must be float32 arithmetic only: no .f64 instruction in the PTX
# (a Python float literal or a float64 scalar argument would promote the element math).
# Reductions that accumulate in float64 on purpose (bias and LayerNorm sums, the loss's row
# sums, dwpe's batch sums) are not listed.
FLOAT32_ONLY = ("bias_act forward", "attention forward", "attention backward", "attention dsum", "sgd", "adamw",
                "lamb direction",
                "scale", "residual", "embedding forward", "embedding dwte", "softmax_xent backward")


def float32_only(name: str) -> bool:
    return name.endswith("float32") and name.startswith(FLOAT32_ONLY)


def find_ptxas():
    import nvidia

    for root in nvidia.__path__:
        hits = glob.glob(os.path.join(root, "cuda_nvcc", "bin", "ptxas"))
        if hits:
            return hits[0]
    return None


def assemble(ptxas, ptx):
    """(registers, shared bytes, spill bytes) of ``ptx`` assembled for sm_90; raises on error."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as fh:
        fh.write(ptx)
        fh.flush()
        out = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{CC[0]}{CC[1]}", fh.name, "-o", os.devnull],
                             capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise RuntimeError(out.stderr[-600:])
    regs = int(re.search(r"Used (\d+) registers", out.stderr).group(1))
    smem = re.search(r"(\d+) bytes smem", out.stderr)
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", out.stderr))
    return regs, int(smem.group(1)) if smem else 0, spills


def parse_shard(argv) -> tuple:
    """(index, count) from ``--shard I/N``; (0, 1) without it."""
    if not argv:
        return 0, 1
    if len(argv) != 2 or argv[0] != "--shard" or not re.fullmatch(r"\d+/[1-9]\d*", argv[1]):
        raise SystemExit("usage: ptx_compile.py [--shard I/N]")
    index, count = map(int, argv[1].split("/"))
    if index >= count:
        raise SystemExit(f"ptx_compile.py: shard {index} of {count} does not exist")
    return index, count


def main(argv) -> int:
    index, count = parse_shard(argv)
    failed = 0
    ptxas = find_ptxas()
    print(f"ptxas: {ptxas or 'not found (PTX only)'}")
    for i, (name, kernel, sig, registers_only) in enumerate(kernels()):
        if i % count != index:
            continue
        try:
            # a kernel's launch bound (1024-thread attention tiles) caps its registers: pass it on
            bound = getattr(kernel, "targetoptions", {}).get("launch_bounds")
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=CC, **({"launch_bounds": bound} if bound else {}))
            sass = assemble(ptxas, ptx) if ptxas else None
        except Exception as exc:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:600]}")
            continue
        code = [line for line in ptx.splitlines() if not line.lstrip().startswith("//")]
        if float32_only(name) and any(".f64" in line for line in code):
            failed += 1
            print(f"FAIL {name}: float64 arithmetic in a float32 kernel (a float literal or scalar promotes it)")
            continue
        spilled = ".local" in ptx or (sass is not None and sass[2] > 0)
        if registers_only and spilled:
            failed += 1
            print(f"FAIL {name}: uses local memory (accumulators spilled out of registers) {sass}")
            continue
        detail = f", {sass[0]} registers, {sass[1]} B shared, {sass[2]} B spilled" if sass else ""
        print(f"ok   {name}: {ptx.count(chr(10))} PTX lines{detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
