"""A multi-layer perceptron classifier: Linear+act x k -> Linear -> softmax CE."""

from __future__ import annotations

import time

import numpy as np

from ..nn.flat import FlatParams
from ..nn.layers import Linear, SoftmaxCrossEntropy


class MLP:
    """Layers in order, parameters in one :class:`FlatParams`.

    ``forward(x, y)`` returns (loss_sum, correct) over the B rows of x (B, D);
    ``backward()`` writes (or, with accumulate, adds) d(mean loss)/d(params)
    into ``flat.grad``.
    """

    def __init__(self, device, n_in, hidden, n_classes, activation="relu"):
        self.device = device
        widths = [n_in, *hidden, n_classes]
        last = len(widths) - 2
        self.layers = [Linear(device, f"fc{i}", widths[i], widths[i + 1],
                              activation=activation if i < last else "identity", needs_dx=i > 0)
                       for i in range(len(widths) - 1)]
        self.loss = SoftmaxCrossEntropy(device)
        self.flat = FlatParams(device, [p for layer in self.layers for p in layer.params])
        for layer in self.layers:
            layer.bind(self.flat)
        self.tracer = None  # an hpctrain.trace.Tracer: a span per layer in forward and backward

    def use_grad_buffer(self, buf):
        """Keep the gradients in ``buf`` (P elements on this device, e.g. a slot of the shm
        all-reduce's shared window) from now on: the current gradients are copied in and
        every layer's gradient views are rebound."""
        buf[:] = self.flat.grad
        self.flat.grad = buf
        for layer in self.layers:
            layer.bind(self.flat)

    def init(self, seed: int):
        """Deterministic initial weights from ``seed``: drawn in float64 on the host,
        cast to the compute dtype, copied to the device in one transfer."""
        rng = np.random.default_rng(seed)
        host = np.concatenate([a.reshape(-1) for layer in self.layers for a in layer.init_host(rng)])
        self.device.copy_from_host(self.flat.data, host)

    def forward(self, x, y):
        tr = self.tracer
        for layer in self.layers:
            t0 = tr and time.perf_counter()
            x = layer.forward(x)
            if tr is not None:
                tr.complete(f"forward {layer.name}", t0, "layer", sync=True)
        t0 = tr and time.perf_counter()
        out = self.loss.forward(x, y)
        if tr is not None:
            tr.complete("forward loss", t0, "layer", sync=True)
        return out

    def backward(self, accumulate=False, ready=None):
        """Gradients into ``flat.grad``; ``ready(name)`` is called for each parameter as
        soon as its gradient is final (the bucketed all-reduce starts on it)."""
        tr = self.tracer
        t0 = tr and time.perf_counter()
        dout = self.loss.backward()
        if tr is not None:
            tr.complete("backward loss", t0, "layer", sync=True)
        for layer in reversed(self.layers):
            t0 = tr and time.perf_counter()
            dout = layer.backward(dout, accumulate)
            if tr is not None:
                tr.complete(f"backward {layer.name}", t0, "layer", sync=True)
            if ready is not None:
                for name, _ in layer.params:
                    ready(name)

    def predict_correct(self, x, y) -> int:
        """Correctly classified rows of (x, y); no gradients are touched."""
        return self.forward(x, y)[1]
