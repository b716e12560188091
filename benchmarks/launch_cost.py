"""Host time per kernel launch from Python: what an op costs when the GPU is not the limit.

    python benchmarks/launch_cost.py            # or as part of benchmarks/kernels.py

Each variant launches a scale kernel on a 1024-element buffer a few thousand times
and divides the host's wall time by the count (each kernel takes the GPU about a
microsecond, so the GPU waits on the host, and the host side is what is timed):

  - op table: ``dev.ops.scale(buf, 1.0)``, as layers call ops (argument checks, the
    launcher's grid arithmetic, numba's dispatch);
  - configured: ``kernel[grid, block, stream](buf, factor)`` bound once, then called
    (numba's argument typing and marshalling);
  - compiled: the compiled kernel's own ``launch`` (argument marshalling only);
  - PyTorch: ``x.mul_(1.0)`` on the same stream, where PyTorch runs on a GPU.
A GPT step launches a few hundred kernels, so tens of microseconds each show in its time.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _per_call_us(fn, dev, calls):
    for _ in range(min(200, calls)):
        fn()
    dev.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    dev.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def measure(dev, calls: int = 3000) -> dict:
    """{variant: microseconds of host time per launch} on ``dev`` (a CudaDevice)."""
    from hpctrain.kernels import scale_cuda

    buf = dev.from_host(np.ones(1024, dev.dtype))
    factor = dev.dtype.type(1.0)
    configured = scale_cuda.scale_kernel[4, 256, dev.stream]
    out = {"op table": _per_call_us(lambda: dev.ops.scale(buf, 1.0), dev, calls),
           "configured": _per_call_us(lambda: configured(buf, factor), dev, calls)}
    from numba import typeof

    compiled = scale_cuda.scale_kernel.overloads.get((typeof(buf), typeof(factor)))  # this dtype's, not another
    if compiled is not None and hasattr(compiled, "launch"):  # not on the simulator
        with warnings.catch_warnings():  # numba-cuda 0.30 warns about its own stream type here
            warnings.simplefilter("ignore", DeprecationWarning)
            out["compiled"] = _per_call_us(
                lambda: compiled.launch((buf, factor), (4, 1, 1), (256, 1, 1), dev.stream, 0), dev, calls)
    try:
        import torch

        from hpctrain.device import simulated
        if torch.cuda.is_available() and not simulated():
            x = torch.ones(1024, device="cuda")
            with torch.cuda.stream(torch.cuda.ExternalStream(int(dev.stream))):
                out["PyTorch"] = _per_call_us(lambda: x.mul_(1.0), dev, calls)
    except ImportError:
        pass
    return out


def main() -> None:
    from hpctrain.device import CudaDevice, cuda_status, simulated

    if cuda_status()[0] == 0:
        sys.exit("launch_cost.py: no GPU (or NUMBA_ENABLE_CUDASIM=1 for a smoke test)")
    if simulated():  # the test tool, opted into: the simulator safe for its shared arrays and barriers
        from hpctrain.testing.simulator import make_thread_safe

        make_thread_safe()
    dev = CudaDevice("float32")
    print(dev.describe())
    for name, us in measure(dev, 20 if simulated() else 3000).items():
        print(f"{name:>12}: {us:8.1f} us per launch")


if __name__ == "__main__":
    main()
