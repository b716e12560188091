"""CUDA kernels against their CPU twins (correctness) and the GPU's own ceilings (speed).

    python benchmarks/kernels.py                       # on a GPU node: validate, then time
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/kernels.py --small   # smoke test, no GPU needed

First each kernel runs once at a moderate, ragged size and is compared with
its CPU twin (run in float64 on the same inputs, so the bound is the kernel's
own rounding); a kernel that fails is reported FAIL, not timed, and the exit
status is 1. Then each kernel is timed with CUDA events on the device's stream
(--warmup untimed calls first, JIT included; then --repeats calls) and the
median and min-max are reported next to ceilings measured in the same run:
  - memory-bound kernels: GB/s against device-to-device copy bandwidth (the
    better of cudaMemcpy D2D and a grid-stride copy kernel), target >= 0.8x;
  - GEMMs: GFLOP/s against cuBLAS fp32 SGEMM through CuPy at the same shapes
    (TF32 off), target >= 0.5x at 4096^3; "n/a" without CuPy;
  - the GPT's layernorm, attention and whole step (benchmarks/kernels_gpt.py):
    copy bandwidth, PyTorch's scaled_dot_product_attention and PyTorch eager on
    the same GPT shape; "n/a" without PyTorch.
Last, the host time of one kernel launch (benchmarks/launch_cost.py) beside
PyTorch's. Writes JSON (--json). Exit 2 when there is no GPU (and no simulator).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from numba import cuda  # noqa: E402  (creates no CUDA context)

from hpctrain.device import CPU_OPS, CudaDevice, cuda_status, gpu_name, simulated  # noqa: E402
from hpctrain.kernels import adamw, sgd  # noqa: E402
from hpctrain.kernels import softmax_xent as sx  # noqa: E402
from hpctrain.kernels.support.cuda_support import THREADS, blocks_for  # noqa: E402
from hpctrain.kernels.linear import gemm_cuda  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels_gpt  # noqa: E402 - beside this file: the GPT's rows
import launch_cost  # noqa: E402 - beside this file: host time per kernel launch

BW_TARGET, GEMM_TARGET = 0.8, 0.5
SPIN_ITERS = 2000  # x ~1 us nanosleep: the GPU stays busy while Python enqueues a timed call


@cuda.jit
def _spin(n):
    # Queued before each timed call, so the host enqueues e0, the call's
    # launches and e1 while this runs: the events then measure the kernels,
    # not Python's launch overhead (which can exceed a 20 us kernel). CC >= 7.0.
    for _ in range(n):
        cuda.nanosleep(1000)


@cuda.jit
def _copy(src, dst):
    i = cuda.grid(1)
    while i < src.size:
        dst[i] = src[i]
        i += cuda.gridsize(1)


def time_ms(fn, dev, args):
    """Per-call times in ms of ``fn()`` on ``dev.stream``: CUDA events, after --warmup calls."""
    sim = simulated()
    for _ in range(args.warmup):
        fn()
    dev.synchronize()
    e0, e1, out = cuda.event(), cuda.event(), []
    for _ in range(args.repeats):
        if not sim:
            _spin[1, 1, dev.stream](SPIN_ITERS)
        t = time.perf_counter()
        e0.record(dev.stream)
        fn()
        e1.record(dev.stream)
        e1.synchronize()
        # the simulator's events hold no time (0.0): use the host clock there
        out.append(1e3 * (time.perf_counter() - t) if sim else e0.elapsed_time(e1))
    return out


# ---- validation: each kernel once against its CPU twin -----------------------------
def check(name, got, ref, bound):
    """|got - ref| <= bound elementwise (and finite); prints one line; returns pass/fail."""
    err = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
    ok = bool(np.all(np.isfinite(got)) and np.all(err <= bound))
    with np.errstate(divide="ignore", invalid="ignore"):  # bound 0 (exact ops): any error is inf
        worst = float(np.max(np.where(err == 0, 0.0, err / bound)))
    print(f"  {name:34s} {'ok  ' if ok else 'FAIL'}  max |err|/bound = {worst:.3g}")
    return ok


def validate(dev, small, rng, step_dev=None):
    """{check name: passed}. Shapes leave tiles, blocks and grid-stride loops partly filled."""
    ops, dt, u = dev.ops, dev.dtype, float(np.finfo(dev.dtype).eps) / 2  # u: unit roundoff
    up, host, f64 = dev.from_host, dev.to_host, (lambda a: np.array(a, np.float64))

    def rnd(*shape):
        return rng.standard_normal(shape).astype(dt)

    def norm(ref, k=16):
        # Elementwise ops round a handful of times per element on O(1) inputs:
        # within k ulps of the largest result is generous for FMA contraction,
        # the GPU's libdevice exp/tanh and the simulator's float32 scalar rules,
        # yet a wrong index or formula misses it by orders of magnitude.
        return k * u * np.max(np.abs(ref))

    ok = {}
    # GEMM: a length-K dot product in float32 is within gamma_K |a||b| of the
    # exact one (gamma_K ~ K u); x2 for the final store and slack, +2 for short K.
    M, N, K = (33, 20, 17) if small else (333, 257, 190)
    for name, ta, tb in (("gemm_nn", False, False), ("gemm_tn", True, False), ("gemm_nt", False, True)):
        a, b = rnd(*((K, M) if ta else (M, K))), rnd(*((N, K) if tb else (K, N)))
        A, Bm = f64(a.T if ta else a), f64(b.T if tb else b)
        passed = True
        # the small and large tilings: the timed 4096^3 rows run "large", the MLP shapes "small" (tiny is
        # for skinny products, M or N at most 16, none of the timed shapes)
        for tile in ("small", "large"):
            c = dev.empty((M, N))
            gemm_cuda(up(a), up(b), c, ta, tb, stream=dev.stream, tile=tile)
            passed &= check(f"{name} ({tile} tiles)", host(c), A @ Bm, 2 * (K + 2) * u * (np.abs(A) @ np.abs(Bm)))
        ok[name] = passed
    Bt, I, O = (17, 9, 12) if small else (256, 192, 160)
    x, w, dz, dw0 = rnd(Bt, I), rnd(I, O), rnd(Bt, O), rnd(I, O)
    X, W, DZ = f64(x), f64(w), f64(dz)
    z, Z = np.empty((Bt, O)), dev.empty((Bt, O))
    CPU_OPS.linear_forward(X, W, z)
    ops.linear_forward(up(x), up(w), Z)
    ok["linear_forward"] = check("linear_forward z", host(Z), z, 2 * (I + 2) * u * (np.abs(X) @ np.abs(W)))
    dx, dw, DXg, DWg = np.empty((Bt, I)), f64(dw0), dev.empty((Bt, I)), up(dw0)
    CPU_OPS.linear_backward(DZ, X, W, dx, dw, accumulate=True)
    ops.linear_backward(up(dz), up(x), up(w), DXg, DWg, accumulate=True)
    ok["linear_backward"] = all([
        check("linear_backward dx", host(DXg), dx, 2 * (O + 2) * u * (np.abs(DZ) @ np.abs(W).T)),
        check("linear_backward dw (accumulate)", host(DWg), dw,
              2 * (Bt + 2) * u * (np.abs(X).T @ np.abs(DZ) + np.abs(dw0)))])
    Bb, Ob = (24, 40) if small else (300, 100)
    z0, bias, dout = rnd(Bb, Ob), rnd(Ob), rnd(Bb, Ob)
    for act in ("relu", "gelu"):
        zr, out, Zg, OUTg = f64(z0), np.empty((Bb, Ob)), up(z0), dev.empty((Bb, Ob))
        CPU_OPS.bias_act_forward(zr, f64(bias), out, act)
        ops.bias_act_forward(Zg, up(bias), OUTg, act)
        ok[f"bias_act_forward[{act}]"] = all([check(f"bias_act_forward[{act}] z", host(Zg), zr, norm(zr)),
                                              check(f"bias_act_forward[{act}] out", host(OUTg), out, norm(out))])
        dzr, db, DZg, DBg = np.empty((Bb, Ob)), np.empty(Ob), dev.empty((Bb, Ob)), dev.empty(Ob)
        CPU_OPS.bias_act_backward(f64(dout), f64(host(Zg)), dzr, db, act)  # the same z the GPU saw
        ops.bias_act_backward(up(dout), Zg, DZg, DBg, act)
        ok[f"bias_act_backward[{act}]"] = all([  # db: a column sum of B terms, bounded like a dot product
            check(f"bias_act_backward[{act}] dz", host(DZg), dzr, norm(dzr)),
            check(f"bias_act_backward[{act}] db", host(DBg), db, 2 * (Bb + 2) * u * np.abs(dzr).sum(0))])
    Bs, Cs = (3, 150) if small else (300, 1000)
    logits, labels = (3 * rnd(Bs, Cs)).astype(dt), rng.integers(0, Cs, Bs).astype(np.int64)
    probs, Pg, Lg = np.empty((Bs, Cs)), dev.empty((Bs, Cs)), up(labels, np.int64)
    loss, correct = CPU_OPS.softmax_xent_forward(f64(logits), labels, probs)
    got_loss, got_correct = ops.softmax_xent_forward(up(logits), Lg, Pg)
    # a row's sum of C exps carries <= (C + 2) u relative error (float32 sums in
    # the simulator), so probs <= (C + 4) u relative and log(sum) (C + 2) u
    # absolute; m and logit_y add u |logit| each. The argmax is exact.
    tiny = np.finfo(dt).tiny
    ok["softmax_xent_forward"] = all([
        check("softmax_xent_forward probs", host(Pg), probs, 2 * (Cs + 4) * u * probs + tiny),
        check("softmax_xent_forward loss_sum", got_loss, loss,
              2 * Bs * u * ((Cs + 2) + 2 * np.abs(logits).max())),
        check("softmax_xent_forward correct", got_correct, correct, 0)])
    dl, DLg = np.empty((Bs, Cs)), dev.empty((Bs, Cs))
    CPU_OPS.softmax_xent_backward(f64(host(Pg)), labels, 1.0 / Bs, dl)
    ops.softmax_xent_backward(Pg, Lg, 1.0 / Bs, DLg)  # probs * scale (- scale): two roundings at most
    ok["softmax_xent_backward"] = check("softmax_xent_backward", host(DLg), dl, 4 * u * (np.abs(dl) + 1.0 / Bs))
    # training's fused op, over the logits in place: the device's forward then backward, bit for bit
    Xg = up(logits)
    fused_loss, fused_correct = ops.softmax_xent_fused(Xg, Lg, 1.0 / Bs, Xg)
    ok["softmax_xent_fused"] = all([check("softmax_xent_fused dlogits", host(Xg), host(DLg), 0.0),
                                    check("softmax_xent_fused loss_sum", fused_loss, got_loss, 0.0),
                                    check("softmax_xent_fused correct", fused_correct, got_correct, 0)])
    n = 600 if small else 100_003
    p, g, m, v = rnd(n), rnd(n), rnd(n), (0.5 + rng.random(n)).astype(dt)  # v > 0: sqrt(v) well conditioned
    pr, vr, Pg, Vg = f64(p), f64(m), up(p), up(m)
    CPU_OPS.sgd_update(pr, f64(g), vr, sgd.hyperparameters(np.float64, 0.1, 0.9, 1e-2), True)
    ops.sgd_update(Pg, up(g), Vg, up(sgd.hyperparameters(dt, 0.1, 0.9, 1e-2)), True)
    ok["sgd_step"] = all([check("sgd_step p", host(Pg), pr, norm(pr)), check("sgd_step v", host(Vg), vr, norm(vr))])
    pr, mr, vr, Pg, Mg, Vg = f64(p), f64(m), f64(v), up(p), up(m), up(v)
    CPU_OPS.adamw_update(pr, f64(g), mr, vr, adamw.hyperparameters(np.float64, 3, 1e-2, 0.9, 0.999, 1e-8, 1e-2))
    ops.adamw_update(Pg, up(g), Mg, Vg, up(adamw.hyperparameters(dt, 3, 1e-2, 0.9, 0.999, 1e-8, 1e-2)))
    ok["adamw_step"] = all([check(f"adamw_step {k}", host(got), ref, norm(ref))
                            for k, got, ref in (("p", Pg, pr), ("m", Mg, mr), ("v", Vg, vr))])
    Sg = up(p)
    ops.scale(Sg, 1.0 / 3.0)  # one multiply by the same dtype-rounded factor: bitwise equal to the twin
    ok["scale"] = check("scale", host(Sg), CPU_OPS.scale(p.copy(), 1.0 / 3.0), 0.0)
    ok.update(kernels_gpt.validate(dev, small, rng, check, step_dev or dev))
    return ok


# ---- what is timed -----------------------------------------------------------------
def xent_forward_kernels(dev, logits, labels, probs):
    """softmax_xent_forward_cuda without its 16-byte copy to the host and the sync it
    implies: the two kernels alone, for the bandwidth ratio."""
    sx.softmax_xent_totals_cuda(logits, labels, probs, stream=dev.stream, scratch=dev.scratch)


def cases(dev, small, rng, cp, step_dev=None):
    """Rows to time: (kernel, shape, unit, work, fn, cuBLAS fn or None, target); the
    kernel's first word names its validation.

    work is FLOPs (GEMM: 2 M N K) or bytes, counting each array read or written
    once per call (s = itemsize); small internal scratch (float64 partial sums,
    per-row loss) is left out (< 1 % at these sizes).
    """
    s, ops = dev.dtype.itemsize, dev.ops

    def arr(*shape):
        return dev.from_host(rng.random(shape, dtype=dev.dtype) - 0.5)

    def cublas(*mms):  # CuPy matmuls on the device's stream, zero-copy views of the same arrays
        if cp is None:
            return None
        views = [(cp.asarray(a), cp.asarray(b), cp.asarray(c), ta, tb) for a, b, c, ta, tb in mms]
        stream = cp.cuda.ExternalStream(int(dev.stream))

        def run():
            with stream:
                for a, b, c, ta, tb in views:
                    cp.matmul(a.T if ta else a, b.T if tb else b, out=c)
        return run

    n = 32 if small else 4096
    a, b, c = arr(n, n), arr(n, n), arr(n, n)
    g_tgt = GEMM_TARGET if dev.dtype == np.float32 else None  # the target is for fp32
    rows = [(f"gemm_{t}", f"{n}x{n}x{n}", "GFLOP/s", 2 * n ** 3,
             lambda ta=ta, tb=tb: gemm_cuda(a, b, c, ta, tb, stream=dev.stream),
             cublas((a, b, c, ta, tb)), g_tgt)
            for t, ta, tb in (("nn", False, False), ("tn", True, False), ("nt", False, True))]
    B, I, O = (32, 16, 24) if small else (4096, 1024, 1024)
    x, w, z, dx, dw = arr(B, I), arr(I, O), arr(B, O), arr(B, I), arr(I, O)
    shape = f"B{B} {I}->{O}"
    rows += [("linear_forward", shape, "GFLOP/s", 2 * B * I * O, lambda: ops.linear_forward(x, w, z),
              cublas((x, w, z, False, False)), None),
             ("linear_backward (dw, dx)", shape, "GFLOP/s", 4 * B * I * O, lambda: ops.linear_backward(z, x, w, dx, dw),
              cublas((x, z, dw, True, False), (z, w, dx, False, True)), None)]
    B, O = (16, 32) if small else (8192, 4096)
    zb, bias, out, dout, db = arr(B, O), arr(O), arr(B, O), arr(B, O), arr(O)
    for act in ("relu", "gelu"):
        rows += [(f"bias_act_forward[{act}]", f"{B}x{O}", "GB/s", (3 * B * O + O) * s,  # z b in, z out out
                  lambda act=act: ops.bias_act_forward(zb, bias, out, act), None, BW_TARGET),
                 (f"bias_act_backward[{act}]", f"{B}x{O}", "GB/s", (3 * B * O + O) * s,  # dout z in, dz db out
                  lambda act=act: ops.bias_act_backward(dout, zb, out, db, act), None, BW_TARGET)]
    # 128 MiB per array: beyond H100/H200's 50 MB L2, so repeats cannot hit in cache
    B, C = (4, 32) if small else (32768, 1024)
    logits, probs, dlogits = arr(B, C), arr(B, C), arr(B, C)
    labels = dev.from_host(rng.integers(0, C, B), np.int64)
    xent_bytes = 2 * B * C * s + 8 * B  # logits (or probs) in, probs (or dlogits) out, labels in
    rows += [("softmax_xent_forward", f"{B}x{C}", "GB/s", xent_bytes,
              lambda: xent_forward_kernels(dev, logits, labels, probs), None, BW_TARGET),
             ("softmax_xent_forward +2-scalar D2H", f"{B}x{C}", "GB/s", xent_bytes,  # the op as layers call it
              lambda: ops.softmax_xent_forward(logits, labels, probs), None, None),
             ("softmax_xent_backward", f"{B}x{C}", "GB/s", xent_bytes,
              lambda: ops.softmax_xent_backward(probs, labels, 1.0 / B, dlogits), None, BW_TARGET),
             # training's op: forward and backward in one kernel, the gradient written over the logits
             # (it reads each row three times; its GB/s counts one read and one write, as the rows above)
             ("softmax_xent_fused +2-scalar D2H", f"{B}x{C}", "GB/s", xent_bytes,
              lambda: ops.softmax_xent_fused(dlogits, labels, 1.0 / B, dlogits), None, None)]
    P = 32 if small else 100_000_000
    p, g, m = arr(P), arr(P), arr(P)
    v = dev.from_host(rng.random(P, dtype=dev.dtype))  # >= 0, as an Adam second moment is
    sgd_hyper = dev.from_host(sgd.hyperparameters(dev.dtype, 1e-3, 0.9, 1e-4))
    adamw_hyper = dev.from_host(adamw.hyperparameters(dev.dtype, 10, 1e-3, 0.9, 0.999, 1e-8, 1e-2))
    rows += [("sgd_step (momentum, nesterov)", f"P={P:,}", "GB/s", 5 * P * s,  # p g v in, p v out
              lambda: ops.sgd_update(p, g, m, sgd_hyper, True), None, BW_TARGET),
             ("adamw_step", f"P={P:,}", "GB/s", 7 * P * s,  # p g m v in, p m v out
              lambda: ops.adamw_update(p, g, m, v, adamw_hyper), None, BW_TARGET),
             ("scale", f"P={P:,}", "GB/s", 2 * P * s, lambda: ops.scale(g, 1.0), None, BW_TARGET)]  # buf in, out
    return rows + kernels_gpt.cases(dev, small, rng, step_dev or dev)


def copy_ceiling(dev, small, rng, args):
    """Device-to-device copy GB/s (read + write bytes): cudaMemcpy D2D and a copy kernel."""
    n = 1024 if small else 100_000_000
    src, dst = dev.from_host(rng.random(n, dtype=dev.dtype)), dev.empty(n)
    nbytes = 2 * n * dev.dtype.itemsize
    memcpy = np.median(time_ms(lambda: dst.copy_to_device(src, stream=dev.stream), dev, args))
    kernel = np.median(time_ms(lambda: _copy[blocks_for(n), THREADS, dev.stream](src, dst), dev, args))
    if not np.array_equal(dev.to_host(dst), dev.to_host(src)):
        raise SystemExit("kernels.py: the copy kernel did not copy; the ceiling is void")
    gbs = {"memcpy D2D": nbytes / memcpy / 1e6, "copy kernel": nbytes / kernel / 1e6}
    best = max(gbs, key=gbs.get)
    return {"gbs": gbs[best], "source": best, "bytes": nbytes, **{f"{k} GB/s": x for k, x in gbs.items()}}


def num(x):  # thousands separated when large, 3 significant digits when small (the simulator)
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def load_cupy():
    """(cupy module or None, a line saying which cuBLAS yardstick this run has)."""
    if simulated():
        return None, "cuBLAS: n/a (simulator)"
    os.environ["CUPY_TF32"] = "0"  # plain fp32 SGEMM: CuPy uses TF32 tensor cores only when this is 1
    try:
        import cupy
    except ImportError:
        return None, "cuBLAS: n/a (CuPy not installed)"
    try:  # installed is not usable: a CuPy built for another CUDA fails here, once, not mid-table
        (cupy.ones((64, 64), cupy.float32) @ cupy.ones((64, 64), cupy.float32)).sum().item()
    except Exception as exc:  # noqa: BLE001 - any failure means: no yardstick, and why
        return None, f"cuBLAS: n/a (CuPy {cupy.__version__} unusable: {type(exc).__name__}: {exc})"
    return cupy, f"cuBLAS: CuPy {cupy.__version__} matmul at each GEMM row's shapes, CUPY_TF32=0"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="small shapes (3..600): a smoke test, e.g. on the simulator")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per kernel (default 20; 3 with --small)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls first: JIT compile, first touch, clocks up (default 3; 1 with --small; "
                        "0 is taken only on the simulator, which has none of the three)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="compute dtype")
    p.add_argument("--json", default="runs/bench/kernels.json", help="where to write results")
    p.add_argument("--gemm", default="auto", choices=["auto", "numba", "cublas"],
                   help="the GEMMs of the whole-GPT-step row, as train.gemm (default auto: cuBLAS where CuPy "
                        "runs); the GEMM and Linear rows always time the numba kernels against cuBLAS")
    args = p.parse_args()
    args.repeats = args.repeats or (3 if args.small else 20)
    # On a GPU the first call compiles and touches memory, so at least one untimed call. The
    # simulator compiles nothing and its times are not GPU times: there --warmup 0 leaves out a
    # second run of every row (the GPT step's alone is seconds); each row still runs once, timed.
    if not (args.warmup == 0 and simulated()):
        args.warmup = max(1, args.warmup or (1 if args.small else 3))
    n_gpus, why = cuda_status()
    if n_gpus == 0:
        print(f"kernels.py: no GPU ({why}); run it on a GPU node, or try the script with "
              f"NUMBA_ENABLE_CUDASIM=1 ... --small", file=sys.stderr)
        sys.exit(2)
    sim = simulated()
    if sim and not args.small:
        print("kernels.py: the CUDA simulator runs every GPU thread as a Python thread; add --small",
              file=sys.stderr)
        sys.exit(2)
    warnings.filterwarnings("ignore", message="Simulator timings are bogus")
    if sim:  # the test tool, opted into: the simulator safe for its shared arrays and barriers
        from hpctrain.testing.simulator import make_thread_safe

        make_thread_safe()
    dev = CudaDevice(args.dtype)
    step_dev = dev.with_gemm(args.gemm)  # same stream: one timer serves both
    print(dev.describe())
    if sim:
        print("NOTE: numba CUDA simulator: kernels ran as Python threads on the CPU. The times below are "
              "NOT GPU measurements; targets are n/a.")
    rng = np.random.default_rng(2024)
    print("validation against the CPU twins (run in float64 on the same inputs):")
    ok = validate(dev, args.small, rng, step_dev)
    cp, cublas_line = load_cupy()
    ceiling = copy_ceiling(dev, args.small, rng, args)
    print(f"copy ceiling: {num(ceiling['gbs'])} GB/s ({ceiling['source']}; memcpy D2D "
          f"{num(ceiling['memcpy D2D GB/s'])}, copy kernel {num(ceiling['copy kernel GB/s'])} GB/s; "
          f"{ceiling['bytes']:,} bytes read + written per copy)")
    print(cublas_line)
    no_target = "n/a (simulator)" if sim else "n/a (--small)" if args.small else None
    results = []
    for kernel, shape, unit, work, fn, ref_fn, target in cases(dev, args.small, rng, cp, step_dev):
        row = {"kernel": kernel, "shape": shape, "unit": unit, "work": work, "validated": ok[kernel.split()[0]]}
        results.append(row)
        if not row["validated"]:
            continue
        ms = time_ms(fn, dev, args)
        row.update(median_ms=float(np.median(ms)), min_ms=min(ms), max_ms=max(ms))
        per_ms = 1e3 if unit == "tokens/s" else 1e-6  # per ms -> per s (tokens), or per s then G (FLOP, B)
        row["rate"] = work / row["median_ms"] * per_ms
        ref_fn, ref_name = ref_fn if isinstance(ref_fn, tuple) else (ref_fn, "cuBLAS")
        if unit == "GB/s":
            row["ceiling"], row["ceiling_name"] = ceiling["gbs"], f"copy ({ceiling['source']})"
        elif ref_fn is not None:
            row["ceiling"], row["ceiling_name"] = work / np.median(time_ms(ref_fn, dev, args)) * per_ms, ref_name
        row["ratio"] = row["rate"] / row["ceiling"] if "ceiling" in row else None
        row["target"] = target if no_target is None else None
        row["met"] = bool(row["ratio"] >= target) if row["target"] and row["ratio"] is not None else None
    head = "| kernel | shape | median ms | spread ms (min-max) | rate | ceiling | ratio | target | met? |"
    print("\n" + head + "\n" + "|---" * (head.count("|") - 1) + "|")
    for r in results:
        if not r["validated"]:
            print(f"| {r['kernel']} | {r['shape']} | not timed: validation FAIL | | | | | | |")
            continue
        ceil = f"{num(r['ceiling'])} {r['unit']} {r['ceiling_name']}" if "ceiling" in r else "n/a"
        tgt = (no_target or "-") if r["target"] is None else f">= {r['target']:.1f}x"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        ratio = "n/a" if r["ratio"] is None else f"{num(r['ratio'])}x"
        print(f"| {r['kernel']} | {r['shape']} | {r['median_ms']:.4g} | {r['min_ms']:.4g}-{r['max_ms']:.4g} | "
              f"{num(r['rate'])} {r['unit']} | {ceil} | {ratio} | {tgt} | {met} |")
    launches = launch_cost.measure(dev, 1 if sim else 3000)  # simulated: each variant runs (2 launches), no more
    print("\nhost time per launch (benchmarks/launch_cost.py): "
          + ", ".join(f"{k} {v:.1f} us" for k, v in launches.items()))
    report = {"benchmark": "kernels", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": dev.describe(),
              "gpu": gpu_name(dev.gpu), "simulator": sim, "numba": __import__("numba").__version__,
              "cupy": getattr(cp, "__version__", None), "dtype": args.dtype, "small": args.small,
              "warmup": args.warmup, "repeats": args.repeats, "ceilings": {"copy": ceiling, "cublas": cublas_line},
              "validation": ok, "rows": results,
              "launch_us": launches}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(report, fh, indent=1, default=float)
    failed = [k for k, v in ok.items() if not v]
    print(f"\n(median of {args.repeats} timed calls after {args.warmup} warm-up; JSON: {args.json})")
    if failed:
        print(f"FAIL: {', '.join(failed)} did not match the CPU twin", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
