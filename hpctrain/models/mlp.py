"""A multi-layer perceptron classifier: Linear+act x k -> Linear -> softmax CE, on the tabular format.

The family functions (:mod:`hpctrain.models`): :func:`open_data` opens ``data.train`` (and
``data.eval``) as /x, /y files; :func:`build` makes the :class:`MLP` for their features and classes.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..data.sampler import DistributedSampler, shard_range
from ..data.tabular import BatchReader, open_dataset
from ..errors import DataError
from ..nn.flat import FlatParams
from ..nn.layers import Linear, SoftmaxCrossEntropy
from . import TrainingData

EVAL_CHUNK_ROWS = 8192  # rows per forward pass during evaluation (bounded memory)


def open_data(cfg, world, device) -> TrainingData:
    """``data.train`` (and ``data.eval``) opened on this rank; collective only through the caller."""
    train = open_dataset(cfg.data.train, "data.train")
    sampler = DistributedSampler(train.n, cfg.train.global_batch, world.rank, world.size, cfg.data.shuffle_seed,
                                 exact=cfg.train.exact_shares)
    reader = BatchReader(train, sampler, device.dtype)
    ev = open_dataset(cfg.data.eval, "data.eval") if cfg.data.eval else None
    if ev and (ev.dim, ev.n_classes) != (train.dim, train.n_classes):
        raise DataError(f"data.eval has {ev.dim} features / {ev.n_classes} classes "
                        f"but data.train has {train.dim} / {train.n_classes}")

    def eval_shard(rank, size, whole=True):  # the evaluation file is always scored whole
        start, stop = shard_range(ev.n, rank, size)
        for lo in range(start, stop, EVAL_CHUNK_ROWS):
            hi = min(stop, lo + EVAL_CHUNK_ROWS)
            yield ev.x[lo:hi], ev.y[lo:hi]

    def close():
        train.close()
        if ev:
            ev.close()

    return TrainingData(sampler, reader, signature=f"N={train.n} D={train.dim} C={train.n_classes}",
                        eval_shard=eval_shard if ev else None, units="samples",
                        describe=f"{train.n} samples x {train.dim} features, {train.n_classes} classes",
                        info={"dim": train.dim, "n_classes": train.n_classes}, close=close)


def build(cfg, device, data: TrainingData, tensor=None, stage: int = 0, *, row_weight=None, tracer=None,
          ranges=None) -> "MLP":
    """``tensor``, ``stage``: unused (the config refuses dist.tensor_parallel > 1 and
    dist.pipeline_parallel > 1 for the MLP); ``row_weight``, ``tracer``, ``ranges``: as the family
    interface says (:mod:`hpctrain.models`). Under ``dist.zero = 3`` the model gets no whole
    parameter or gradient buffer (ZeRO-3 gives it its pools)."""
    return MLP(device, data.info["dim"], cfg.model.hidden, data.info["n_classes"], cfg.model.activation,
               allocate=cfg.dist.zero != 3, row_weight=row_weight, tracer=tracer, ranges=ranges)


class MLP:
    """Layers in order, parameters in one :class:`FlatParams`.

    ``forward(x, y)`` returns (loss_sum, correct) over the B rows of x (B, D);
    ``backward()`` writes (or, with accumulate, adds) d(mean loss)/d(params)
    into ``flat.grad``.
    """

    targets_per_row = 1      # one label per row
    input_dtype = None       # features in the compute dtype
    no_decay = frozenset()   # weight decay (if any) applies to every parameter, as it always has
    matrix_parts: dict = {}  # every weight is one matrix
    flops_per_row = 0        # no MFU: the MLP's step is latency-bound, and the start-up GEMM timing costs 0.2 s

    def __init__(self, device, n_in, hidden, n_classes, activation="relu", allocate: bool = True,
                 row_weight: float | None = None, tracer=None, ranges=None):
        self.device = device
        widths = [n_in, *hidden, n_classes]
        last = len(widths) - 2
        self.layers = [Linear(device, f"fc{i}", widths[i], widths[i + 1],
                              activation=activation if i < last else "identity", needs_dx=i > 0)
                       for i in range(len(widths) - 1)]
        self.loss = SoftmaxCrossEntropy(device, None if row_weight is None else float(row_weight))   # a label a row
        self.flat = FlatParams(device, [p for layer in self.layers for p in layer.params], allocate)
        for layer in self.layers:
            layer.bind(self.flat)
        self.tracer = tracer  # an hpctrain.observe.trace.Tracer: a span per layer in forward and backward
        self.ranges = ranges  # an hpctrain.observe.nvtx.NvtxRanges (train.nvtx): the same as NVTX ranges

    def activation_bytes(self, rows: int) -> int:
        """Bytes of the activation arrays a micro-batch of ``rows`` rows keeps from forward to
        backward on this rank: each Linear's pre-activation z (rows, out) and, for the hidden
        layers, its activation's output, then the loss's probabilities (rows, classes). Not
        counted: the input batch, the parameters, backward's gradient arrays."""
        shapes = [s for layer in self.layers for s in layer.activation_shapes(rows)]
        shapes += self.loss.activation_shapes(rows, self.layers[-1].n_out)
        return sum(math.prod(s) for s in shapes) * self.device.dtype.itemsize

    def checkpoint_hint(self, shapes: dict) -> str:
        hidden = saved_hidden(shapes)
        if hidden is not None and hidden != [layer.n_out for layer in self.layers[:-1]]:
            return f"resume with --set model.hidden={hidden} as it was saved"
        # the same widths: the dataset's features or classes changed
        return "resume with the model.hidden and dataset it was saved with (ckpt inspect shows its config)"

    def use_param_buffer(self, buf, offsets):
        """ZeRO-3: read the parameters from ``buf`` at ``offsets`` per name (the gathered slots,
        :meth:`FlatParams.use_param_layout`); every layer's views are rebound."""
        self.flat.use_param_layout(buf, offsets)
        for layer in self.layers:
            layer.bind(self.flat)

    def use_grad_buffer(self, buf, offsets=None):
        """Keep the gradients in ``buf`` from now on (e.g. a slot of the shm all-reduce's shared
        window: the current gradients are copied in; or ZeRO-2's slots, at ``offsets`` per name:
        see :meth:`FlatParams.use_grad_layout`); every layer's gradient views are rebound."""
        self.flat.use_grad_layout(buf, offsets)
        for layer in self.layers:
            layer.bind(self.flat)

    def init(self, seed: int):
        """Deterministic initial weights from ``seed``: drawn in float64 on the host,
        cast to the compute dtype, copied to the device in one transfer."""
        host = np.concatenate([a.reshape(-1) for _, a in self.initial_values(seed)])
        self.device.copy_from_host(self.flat.data, host)

    def initial_values(self, seed: int):
        """(name, float64 host array) of every parameter's initial value, in flat order, one layer
        at a time (what :meth:`init` writes; ZeRO-3 keeps only its share of each)."""
        rng = np.random.default_rng(seed)
        for layer in self.layers:
            yield from zip((name for name, _ in layer.params), layer.init_host(rng))

    def forward(self, x, y, totals=None, accumulate=False, *, loss_scale: float = 1.0, fetch=None):
        tr, rg = self.tracer, self.ranges
        self.flat.refresh_compute()   # a 16-bit precision's parameter copy, from this step's masters
        for layer in self.layers:
            t0 = tr and time.perf_counter()
            if fetch is not None:
                fetch([name for name, _ in layer.params], True)
            if rg is not None:
                rg.push(f"forward {layer.name}")
            x = layer.forward(x)
            if rg is not None:
                rg.pop()
            if tr is not None:
                tr.complete(f"forward {layer.name}", t0, "layer", sync=True)
        t0 = tr and time.perf_counter()
        out = self.loss.forward(x, y, totals, accumulate, loss_scale)
        if tr is not None:
            tr.complete("forward loss", t0, "layer", sync=True)
        return out

    @property
    def forward_groups(self) -> list:
        """The parameter names forward fetches (ZeRO-3), in its order."""
        return [tuple(n for n, _ in layer.params) for layer in self.layers]

    @property
    def layer_units(self) -> list:
        """The buckets of ``dist.bucket_split = "layers"``: each layer's weight and bias, in flat order."""
        return self.forward_groups

    @property
    def backward_groups(self) -> list:
        """The parameter names each ``claim`` of :meth:`backward` names, in its order."""
        return [tuple(n for n, _ in layer.params) for layer in reversed(self.layers)]

    def backward(self, accumulate=False, ready=None, claim=None, fetch=None):
        """Gradients into ``flat.grad``; ``claim(names)`` before a layer writes its parameters'
        gradients, ``ready(name)`` for each parameter as soon as its gradient is final (the
        bucketed all-reduce starts on it)."""
        tr, rg = self.tracer, self.ranges
        t0 = tr and time.perf_counter()
        dout = self.loss.backward()
        if tr is not None:
            tr.complete("backward loss", t0, "layer", sync=True)
        for layer in reversed(self.layers):
            t0 = tr and time.perf_counter()
            if claim is not None:
                claim([name for name, _ in layer.params])
            if fetch is not None:
                fetch([name for name, _ in layer.params], False)
            if rg is not None:
                rg.push(f"backward {layer.name}")
            dout = layer.backward(dout, accumulate)
            if rg is not None:
                rg.pop()
            if tr is not None:
                tr.complete(f"backward {layer.name}", t0, "layer", sync=True)
            if ready is not None:
                for name, _ in layer.params:
                    ready(name)


def saved_hidden(shapes: dict):
    """model.hidden of the MLP a checkpoint was saved from (/model/fc<i>/weight is (in, out)), or None."""
    layers = sorted((int(p.split("/")[2][2:]), shape) for p, shape in shapes.items()
                    if p.startswith("/model/fc") and p.endswith("/weight") and p.split("/")[2][2:].isdigit())
    if not layers or [i for i, _ in layers] != list(range(len(layers))) or any(len(s) != 2 for _, s in layers):
        return None
    return [int(s[1]) for _, s in layers[:-1]]
