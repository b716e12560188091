"""CUDA graphs of a step's work (``train.cuda_graphs = auto | on | off``): a micro-batch's forward
and backward, and the optimizer's update of each bucket's range, each recorded once and replayed
with one call, so the host's calls per step no longer grow with the layers.

Per key (a micro-batch's shapes and accumulate flags; an update's range and ``graph_key()``): the
first call runs eagerly (compiling and allocating), the second is captured on the device's stream
(:meth:`~hpctrain.device.cuda.CudaDevice.capture`) and then run eagerly, the third is replayed and
checked against the same work run eagerly from the same state (within 1e-3; else graphs stop for
the run, said once), and every later one is replayed. Everything that changes per step reaches the
graphs in device memory, uploaded outside them: the batch, and the optimizer's scalars. The uploads
and the communication stay outside. :func:`why_not` names why a run keeps its steps eager (not a
GPU or no CuPy; tracing, per-op times or synchronised phases; tensor or pipeline parallelism;
ZeRO-2 and 3; offload; LAMB and LARS; a 16-bit precision; several data-parallel ranks under
``auto``). docs/gpu.md says more.
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
                     (cfg.dist.zero == 2, "ZeRO-2 (it reduces every micro-batch inside backward)"),
                     (cfg.dist.zero == 3, "ZeRO-3 (it gathers each layer's parameters inside forward and backward)"),
                     (plan.pipeline > 1, "pipeline parallelism (its stages exchange every micro-batch)")):
        if on:
            return f"{what} waits or communicates inside the step"
    if cfg.dist.offload != "none":
        return f"dist.offload = {cfg.dist.offload} runs the update on the host"
    if cfg.optim.name in ("lamb", "lars"):
        return f"optim.name = {cfg.optim.name} reads its trust ratios on the host every step"
    if cfg.train.precision != "fp32":
        return f"train.precision = {cfg.train.precision} is not captured yet (its conversions run eagerly)"
    if mode == "auto" and plan.dp.size > 1:
        return (f"train.cuda_graphs = auto keeps {plan.dp.size} data-parallel ranks eager (graphs give up "
                f"backward's overlap with the all-reduce); train.cuda_graphs = on takes them")
    return ""


class StepGraphs:
    """A micro-batch's forward and backward (:meth:`run`) and the optimizer's update of a range
    (:meth:`update`), each as a CUDA graph per key, replayed.

    ``device``: a :class:`~hpctrain.device.cuda.CudaDevice` (its ``capture`` and ``replay``);
    ``model``: the model; ``log``: where a failed capture is said once.

    Per key: the first call runs eagerly (compiling and allocating); the second is captured, then
    run eagerly (a capture runs nothing); the third is replayed and checked (:meth:`_replays_as_eager`);
    the rest are replayed.
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
        stream. ``x`` and ``y`` are the device's upload buffers. Key: the shapes and the two flags."""
        key = ("micro-batch", tuple(x.shape), tuple(y.shape), accumulate_loss, accumulate_grads)
        flat = self.model.flat
        self._run(key, lambda: self._micro_batch(x, y, totals, accumulate_loss, accumulate_grads),
                  lambda: [("loss statistics", totals, None, False), ("gradient", flat.grad, flat.slots, False)])

    @staticmethod
    def update_key(optimizer, lo: int, hi: int) -> tuple:
        """The key of ``optimizer``'s update of [lo, hi) this step: the range and ``graph_key()``."""
        return ("update", lo, hi, *optimizer.graph_key())

    def update(self, optimizer, lo: int, hi: int) -> None:
        """``optimizer.update(lo, hi)`` (its scalars already uploaded by ``begin_step``). What is
        watched is the range's parameters and optimizer state only. The caller must keep every other
        thread's work off the stream while a key is captured or checked (:meth:`settling`)."""
        def watched():
            from types import SimpleNamespace

            flat = self.model.flat
            slots = [SimpleNamespace(name=s.name, offset=max(s.offset, lo) - lo,
                                     size=min(s.offset + s.size, hi) - max(s.offset, lo))
                     for s in flat.slots if s.offset < hi and s.offset + s.size > lo]
            return ([("update", flat.data[lo:hi], slots, True)]
                    + [(name, view, None, True) for name, view in optimizer.state_of(lo, hi).items()])
        self._run(self.update_key(optimizer, lo, hi), lambda: optimizer.update(lo, hi), watched)

    def settling(self, key) -> bool:
        """Whether ``key``'s next call captures or checks its graph (rather than running eagerly the
        first time, or replaying): a capture records every launch on the stream, from any thread."""
        return not self.failed and ((key in self._seen and key not in self.graphs) or key in self._unchecked)

    def _run(self, key, body, watched) -> None:
        """``body`` (queues the key's work) eagerly, captured, or replayed; ``watched()``: what it
        writes, as (name, device array, slots to compare one by one or None, whether the check
        measures against the eager change (an update) rather than the values (a fresh write)),
        made only for a capture or a check, not on every replay."""
        graph = None if self.failed else self.graphs.get(key)
        if graph is not None and key in self._unchecked:
            self._unchecked.discard(key)
            self._replays_as_eager(graph, body, watched())   # on a mismatch graphs stop; the eager results stand
        elif graph is not None:
            self.device.replay(graph)
            self.replays += 1
        else:
            if not self.failed and key in self._seen and self._capture(key, body, watched()):
                self._unchecked.add(key)
            self._seen.add(key)
            body()

    def _micro_batch(self, x, y, totals, accumulate_loss, accumulate_grads):
        self.model.forward(x, y, totals=totals, accumulate=accumulate_loss)
        order = [] if not self.ready_order else None
        self.model.backward(accumulate=accumulate_grads, ready=None if order is None else order.append)
        if order:
            self.ready_order = order

    def _replays_as_eager(self, graph, body, watched) -> bool:
        """The graph's first replay, on other inputs than it was captured with, checked against the
        same work run eagerly from the same state: each watched array (or slot) agrees within 1e-3
        of the size of its values, or for an update of the change the eager update made (a
        parameter moves by ~lr against its own size ~1, so a graph that froze the learning rate
        differs by 1e-4 of the values but 1e-1 of the change), else graphs stop for the run, said
        once, and the eager results stand. A capture that missed work, or froze something that
        changes between calls (a batch, a learning rate), leaves results of the call it was
        captured with: differences of that size. (The tests hold replays to the eager step's
        bits; this guard of a running job allows rounding, should cuBLAS pick other kernels under
        capture.)"""
        import numpy as np

        before = self._state(watched)
        self.device.replay(graph)
        self.replays += 1
        got = self._state(watched)
        self._restore(watched, before)
        body()
        want = self._state(watched)
        for (name, _, slots, by_change), b, g, w in zip(watched, before, got, want):
            pieces = [(name, slice(None))] if slots is None else [
                (f"{name} of {s.name}", slice(s.offset, s.offset + s.size)) for s in slots]
            for label, part in pieces:
                change = np.abs(w[part] - b[part]).max(initial=0.0) if by_change else 0.0
                scale = max(change if change > 0 else np.abs(w[part]).max(initial=0.0), 1e-30)
                err = float(np.abs(g[part] - w[part]).max(initial=0.0)) / scale
                if not err <= 1e-3:
                    return self._stop(f"the first replay's {label} differs from the eager step's by {err:.1e} of "
                                      f"its scale")
        return True

    def _state(self, watched) -> list:
        """Host float64 copies of the watched arrays."""
        import numpy as np

        return [np.array(self.device.to_host(a), np.float64) for _, a, _, _ in watched]

    def _restore(self, watched, state) -> None:
        for (_, a, _, _), host in zip(watched, state):
            self.device.copy_from_host(a, host)

    def _capture(self, key, body, watched) -> bool:
        """Capture ``body``'s work; the state is put back afterwards, so work that ran instead of
        being recorded (it would have escaped the capture) cannot count twice when the caller then
        runs it eagerly."""
        before = self._state(watched)
        try:
            graph = self.device.capture(body)
        except Exception as exc:  # noqa: BLE001 - any failure: eager from now on, said once
            self._restore(watched, before)
            return self._stop(f"capturing {key[0]} work failed ({type(exc).__name__}: {exc})")
        self._restore(watched, before)
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
