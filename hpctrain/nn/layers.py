"""Layers: each declares its parameters, binds views into the flat buffers,
and runs ``forward``/``backward`` through the device's kernel table.

Activations are cached per batch size so a training step allocates nothing.
"""

from __future__ import annotations

import numpy as np


class Layer:
    params: tuple = ()   # (name, shape) pairs this layer owns

    def bind(self, flat):
        """Take views of the flat parameter and gradient buffers."""

    def _buffer(self, key, shape):
        cache = self.__dict__.setdefault("_cache", {})
        buf = cache.get((key, shape))
        if buf is None:
            buf = cache[(key, shape)] = self.device.empty(shape)
        return buf


class Linear(Layer):
    """y = x @ W + b with W (I, O) and b (O,); PyTorch's default uniform init."""

    def __init__(self, device, name, n_in, n_out, needs_dx=True):
        self.device, self.name, self.n_in, self.n_out = device, name, n_in, n_out
        self.needs_dx = needs_dx  # the first layer's input gradient is never used
        self.params = ((f"{name}.weight", (n_in, n_out)), (f"{name}.bias", (n_out,)))

    def bind(self, flat):
        self.w, self.b = (flat.view(flat.data, n) for n, _ in self.params)
        self.dw, self.db = (flat.view(flat.grad, n) for n, _ in self.params)

    def init(self, rng: np.random.Generator):
        bound = 1.0 / np.sqrt(self.n_in)
        self.w[...] = rng.uniform(-bound, bound, self.w.shape)
        self.b[...] = rng.uniform(-bound, bound, self.b.shape)

    def forward(self, x):                        # x (B, I) -> (B, O)
        self.x = x
        out = self._buffer("out", (x.shape[0], self.n_out))
        return self.device.ops.linear_forward(x, self.w, self.b, out)

    def backward(self, dout, accumulate=False):  # dout (B, O) -> dx (B, I)
        dx = self._buffer("dx", self.x.shape) if self.needs_dx else None
        return self.device.ops.linear_backward(dout, self.x, self.w, dx, self.dw, self.db, accumulate)


class Activation(Layer):
    """Elementwise ReLU or GELU; keeps its input for backward."""

    def __init__(self, device, kind):
        self.device, self.kind = device, kind
        self._fwd = getattr(device.ops, f"{kind}_forward")
        self._bwd = getattr(device.ops, f"{kind}_backward")

    def forward(self, x):
        self.x = x
        return self._fwd(x, self._buffer("out", x.shape))

    def backward(self, dout, accumulate=False):
        return self._bwd(dout, self.x, self._buffer("dx", dout.shape))


class SoftmaxCrossEntropy(Layer):
    """Mean cross-entropy over this rank's rows; forward returns (loss_sum, correct)."""

    def __init__(self, device):
        self.device = device

    def forward(self, logits, labels):
        self.labels = labels
        self.probs = self._buffer("probs", logits.shape)
        return self.device.ops.softmax_xent_forward(logits, labels, self.probs)

    def backward(self):
        dlogits = self._buffer("dlogits", self.probs.shape)
        # 1/B: the mean over this rank's rows; the all-reduce averages over ranks
        scale = 1.0 / self.probs.shape[0]
        return self.device.ops.softmax_xent_backward(self.probs, self.labels, scale, dlogits)
