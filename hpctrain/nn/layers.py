"""Layers on top of the kernels. Parameters and gradients are views of flat buffers.

Each layer declares its parameters, binds views into the flat buffers, and runs
``forward``/``backward`` through the device's kernel table. Activations are
cached per batch size so a training step allocates nothing; ``activation_shapes``
lists the ones forward keeps, for the models' ``activation_bytes``.
"""

from __future__ import annotations

import numpy as np


class Layer:
    params: tuple = ()   # (name, shape) pairs this layer owns
    # The layer's arrays by (key, shape), made on first use; None until then. Layers that never
    # need theirs at the same time may be given one dict to share one set (the blocks of a
    # recomputing GPT, :class:`~.transformer.Block`). Gradient keys start with "d" (dz, dx, dqkv,
    # dlogits); the other keys are activations forward keeps.
    cache: dict | None = None

    def bind(self, flat):
        """Take views of the flat parameter and gradient buffers."""

    def _buffer(self, key, shape, dtype=None):
        """The array ``key`` of ``shape``, in ``dtype`` (default: the device's compute dtype)."""
        if self.cache is None:
            self.cache = {}
        buf = self.cache.get((key, shape))
        if buf is None:
            buf = self.cache[(key, shape)] = self.device.empty(shape, dtype)
        return buf


class Linear(Layer):
    """y = act(x @ W + b) with W (I, O), b (O,); act is identity, relu or gelu.

    Two ops: the GEMM (``linear_*``) and the fused bias add + activation
    (``bias_act_*``). PyTorch's default uniform init.
    """

    def __init__(self, device, name, n_in, n_out, activation="identity", needs_dx=True):
        self.device, self.name, self.n_in, self.n_out = device, name, n_in, n_out
        self.activation = activation
        self.needs_dx = needs_dx  # the first layer's input gradient is never used
        self.params = ((f"{name}.weight", (n_in, n_out)), (f"{name}.bias", (n_out,)))

    def bind(self, flat):
        self.w, self.b = (flat.param_view(n) for n, _ in self.params)
        self.dw, self.db = (flat.grad_view(n) for n, _ in self.params)

    def init_host(self, rng: np.random.Generator) -> list:
        """Initial (weight, bias) as float64 host arrays, drawn in that order."""
        bound = 1.0 / np.sqrt(self.n_in)
        return [rng.uniform(-bound, bound, (self.n_in, self.n_out)), rng.uniform(-bound, bound, self.n_out)]

    def activation_shapes(self, n) -> list:
        """Shapes of the arrays forward keeps for ``n`` rows: z, and the activation's output
        unless identity (then z is the output). The input x is its producer's."""
        return [(n, self.n_out)] * (1 if self.activation == "identity" else 2)

    def forward(self, x):                         # x (B, I) -> (B, O)
        ops, shape = self.device.ops, (x.shape[0], self.n_out)
        self.x = x
        self.z = ops.linear_forward(x, self.w, self._buffer("z", shape))   # pre-activation, kept
        out = self.z if self.activation == "identity" else self._buffer("out", shape)
        return ops.bias_act_forward(self.z, self.b, out, self.activation)

    def keep_input(self, x):
        """Forward's bookkeeping without its work: with the identity activation backward reads
        only x and the weight (dz is dout; z only lends its shape, and the CUDA kernel's
        identity derivative ignores its values), so a recompute that needs no output calls
        this instead of :meth:`forward` after one forward of the same shape."""
        if self.activation != "identity":
            raise ValueError(f"{self.name}: backward of a {self.activation} Linear reads its pre-activation; "
                             f"run forward")
        self.x = x

    def backward(self, dout, accumulate=False):   # dout (B, O) -> dx (B, I) or None
        ops = self.device.ops
        # identity: dz = dout exactly, so the kernel may write it in place
        dz = dout if self.activation == "identity" else self._buffer("dz", dout.shape)
        ops.bias_act_backward(dout, self.z, dz, self.db, self.activation, accumulate)
        dx = self._buffer("dx", self.x.shape) if self.needs_dx else None
        return ops.linear_backward(dz, self.x, self.w, dx, self.dw, accumulate)


class SoftmaxCrossEntropy(Layer):
    """Mean cross-entropy over this rank's rows; forward returns (loss_sum, correct).

    Forward computes the gradient too (``softmax_xent_fused``) and writes it over the logits,
    which nothing reads after the loss (the head's and the last Linear's backward read their
    input and weights): no probabilities are kept, and backward returns that buffer."""

    def __init__(self, device, row_weight: float | None = None):
        self.device = device
        # d loss / d (one row's loss) in backward; None = 1/B, the mean over this call's B rows.
        # Where ranks' shares differ, size k / (G x the model's predictions per batch row).
        self.row_weight = row_weight

    @staticmethod
    def activation_shapes(n, classes) -> list:
        """Nothing of its own: the gradient it keeps for backward is written over the logits."""
        return []

    def forward(self, logits, labels, totals=None, accumulate=False, loss_scale: float = 1.0):
        """(loss_sum, correct) on the host; or, given ``totals`` (a float64 device array of 2), the
        two written into it (added with ``accumulate``) on the device, without waiting for it:
        a step reads them once (training), an evaluation per batch. ``loss_scale``: fp16's loss
        scale (hpctrain.training.loss_scale), which multiplies the gradient, not the loss."""
        # 1/B: the mean over this rank's rows; the all-reduce averages over ranks
        scale = 1.0 / logits.shape[0] if self.row_weight is None else self.row_weight
        scale *= loss_scale
        self.dlogits = logits
        if totals is not None:
            return self.device.ops.softmax_xent_fused_add(logits, labels, scale, logits, totals, accumulate)
        return self.device.ops.softmax_xent_fused(logits, labels, scale, logits)

    def backward(self):
        return self.dlogits
