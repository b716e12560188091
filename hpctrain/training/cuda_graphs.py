"""CUDA graphs for a micro-batch's forward and backward (``train.cuda_graphs = auto | on | off``).

A GPT step on a GPU issues hundreds of kernel launches, each costing the host tens of
microseconds in Python and numba; at the example GPT's size the GPU waits on the host. A
graph records a micro-batch's forward and backward once and replays them with one launch.

How: the first micro-batch of each key (the batch's shapes and the two accumulate flags) runs
eagerly, which compiles every kernel and allocates every buffer and scratch array; the second
is captured on the device's stream (:meth:`~hpctrain.device.CudaDevice.capture`: CuPy's
stream capture, which records numba's launches and cuBLAS's calls on that stream) and then
run eagerly (a capture runs nothing); the third is replayed and checked against the same
micro-batch run eagerly from the same state (the loss statistics and each parameter's
gradient within 1e-3 of their scale, else the run goes on eagerly and says so), and every
later one is replayed. Replays read the same device buffers, so the batch is
uploaded into them before each replay (outside the graph), the loss statistics go to the
step's device array, and every kernel argument is the same on each replay (the shapes, the
loss's row weight, the flags in the key): nothing in forward or backward changes per step.

Kept out of the graph: uploads, the communication (the reducer starts on every bucket after
backward, when the replay is queued, so backward and the all-reduce do not overlap) and the
optimizer (its learning rate and bias corrections change every step).

Where graphs cannot run, the step is eager and the reason is said once (rank 0's log):
not a GPU (the CPU, numba's simulator) or no CuPy; tracing, per-op timing or synchronised
phases (each waits for the GPU inside forward and backward); tensor parallelism (its
all-reduces run inside forward and backward); ZeRO-2 (it reduces every micro-batch as backward
claims the slots); a capture that raised (the error is said and the step runs eagerly from
then on). ``auto`` also leaves a data-parallel run of several ranks eager, where backward's
overlap with the all-reduce is worth more than the launches (not yet measured); ``on`` takes
graphs there too.
"""

from __future__ import annotations

MODES = ("auto", "on", "off")


def why_not(cfg, device, plan) -> str:
    """Why ``cfg``'s run keeps its steps eager ("" where graphs may run)."""
    mode = cfg.train.cuda_graphs
    if mode == "off":
        return "train.cuda_graphs = off"
    if device.name != "cuda" or not getattr(device, "can_capture", lambda: (False, "no capture"))()[0]:
        why = device.can_capture()[1] if device.name == "cuda" else f"the device is {device.name}"
        return f"graphs need CUDA with CuPy: {why}"
    for on, what in ((cfg.train.trace, "tracing (train.trace)"), (cfg.train.op_times, "train.op_times"),
                     (cfg.train.sync_phases, "train.sync_phases"),
                     (plan.tensor is not None, "tensor parallelism (its all-reduces run inside forward and backward)"),
                     (cfg.dist.zero == 2, "ZeRO-2 (it reduces every micro-batch inside backward)")):
        if on:
            return f"{what} waits or communicates inside the step"
    if mode == "auto" and plan.dp.size > 1:
        return (f"train.cuda_graphs = auto keeps {plan.dp.size} data-parallel ranks eager (graphs give up "
                f"backward's overlap with the all-reduce); train.cuda_graphs = on takes them")
    return ""


class GraphedMicroBatches:
    """Forward and backward of one micro-batch, as a replayed CUDA graph per key.

    ``device``: a :class:`~hpctrain.device.CudaDevice` (its ``capture`` and ``replay``);
    ``model``: the model; ``log``: where a failed capture is said once.
    """

    def __init__(self, device, model, log=None):
        self.device, self.model, self.log = device, model, log
        self.graphs: dict = {}
        self._seen: set = set()
        self._unchecked: set = set()   # keys captured whose first replay is still to be checked
        self.ready_order: list = []  # parameter names in the order backward finishes them (seen eagerly)
        self.failed = ""     # why graphs stopped, once they did
        self.replays = self.captures = 0

    def run(self, x, y, totals, accumulate_loss: bool, accumulate_grads: bool) -> None:
        """The micro-batch's forward into ``totals`` and backward into the gradient, on the device's
        stream: eagerly, captured, or replayed. ``x`` and ``y`` are the device's upload buffers.

        Per key: the first micro-batch runs eagerly; the second is captured, then run eagerly (a
        capture runs nothing); the third is replayed and checked (:meth:`_replays_as_eager`); the
        rest are replayed."""
        key = (tuple(x.shape), tuple(y.shape), accumulate_loss, accumulate_grads)
        args = (x, y, totals, accumulate_loss, accumulate_grads)
        graph = None if self.failed else self.graphs.get(key)
        if graph is not None and key in self._unchecked:
            self._unchecked.discard(key)
            if not self._replays_as_eager(graph, *args):
                return   # graphs stopped; the eager results stand
        elif graph is not None:
            self.device.replay(graph)
            self.replays += 1
        else:
            if not self.failed and key in self._seen and self._capture(key, *args):
                self._unchecked.add(key)
            self._seen.add(key)
            self._body(*args)

    def _body(self, x, y, totals, accumulate_loss, accumulate_grads):
        self.model.forward(x, y, totals=totals, accumulate=accumulate_loss)
        order = [] if not self.ready_order else None
        self.model.backward(accumulate=accumulate_grads, ready=None if order is None else order.append)
        if order:
            self.ready_order = order

    def _replays_as_eager(self, graph, x, y, totals, accumulate_loss, accumulate_grads) -> bool:
        """The graph's first replay, on a batch it was not captured with, checked against the same
        micro-batch run eagerly from the same state: the loss statistics and each parameter's
        gradient agree within 1e-3 of their own scale, else graphs stop for the run, said once,
        and the eager results stand. A capture that missed work, or froze something that changes
        between micro-batches, leaves results of the batch it was captured with: differences of
        the arrays' own size. (The tests hold replays to the eager step's bits; this guard of a
        running job allows rounding, should cuBLAS pick other kernels under capture.)"""
        import numpy as np

        dev, flat = self.device, self.model.flat
        before = self._state(totals)   # what an adding key adds to
        dev.replay(graph)
        self.replays += 1
        got = [np.array(dev.to_host(a), np.float64) for a in (totals, flat.grad)]
        self._restore(totals, before)
        self._body(x, y, totals, accumulate_loss, accumulate_grads)
        want = [np.array(dev.to_host(a), np.float64) for a in (totals, flat.grad)]
        parts = [("loss statistics", got[0], want[0])]
        parts += [(f"gradient of {s.name}", got[1][s.offset:s.offset + s.size],
                   want[1][s.offset:s.offset + s.size]) for s in flat.slots]
        for name, g, w in parts:
            scale = max(float(np.abs(w).max()), 1e-30)
            err = float(np.abs(g - w).max()) / scale
            if not err <= 1e-3:
                return self._stop(f"the first replay's {name} differs from the eager step's by {err:.1e} of its "
                                  f"scale")
        return True

    def _state(self, totals) -> list:
        """Host copies of what a micro-batch writes or adds to: the loss statistics and the gradient."""
        import numpy as np

        return [np.array(self.device.to_host(a)) for a in (totals, self.model.flat.grad)]

    def _restore(self, totals, state) -> None:
        for a, host in zip((totals, self.model.flat.grad), state):
            self.device.copy_from_host(a, host)

    def _capture(self, key, x, y, totals, accumulate_loss, accumulate_grads) -> bool:
        """Capture the micro-batch's work; the state is put back afterwards, so work that ran
        instead of being recorded (it would have escaped the capture) cannot count twice when the
        caller then runs the micro-batch eagerly."""
        before = self._state(totals)
        try:
            graph = self.device.capture(lambda: self._body(x, y, totals, accumulate_loss, accumulate_grads))
        except Exception as exc:  # noqa: BLE001 - any failure: eager from now on, said once
            self._restore(totals, before)
            return self._stop(f"capturing a micro-batch failed ({type(exc).__name__}: {exc})")
        self._restore(totals, before)
        self.graphs[key] = graph
        self.captures += 1
        return True

    def _stop(self, why: str) -> bool:
        """Graphs off for the rest of the run (every key), said once. Returns False."""
        self.failed = why
        self.graphs.clear()
        self._unchecked.clear()
        if self.log is not None:
            self.log.warn(f"train.cuda_graphs: {why}; the steps run eagerly from here on")
        return False
