"""The layers of a pre-LayerNorm transformer, over the kernels (``device.ops``).

Shape legend: B batch rows, T positions, C channels (d_model), NH heads, V
vocabulary, N = B * T rows of the (N, C) activations every layer here takes.
Parameters and gradients are views of the flat buffers (:class:`~.flat.FlatParams`);
activations are cached per shape (:meth:`Layer._buffer`), so a step allocates
nothing once shapes repeat; ``activation_shapes`` lists the ones forward keeps.
Every ``backward`` either overwrites its parameter gradients or, with
``accumulate``, adds to them (gradient accumulation).
"""

from __future__ import annotations

import numpy as np

from .layers import Layer, Linear
from .tensor_parallel import RowParallelLinear


class Embedding(Layer):
    """Token + learned position embedding: out[b, t] = wte[token[b, t]] + wpe[t].

    ``wte`` (V, C) is also the LM head's weight (:class:`TiedHead`); ``wpe`` (context, C).
    """

    def __init__(self, device, vocab: int, context: int, channels: int):
        self.device, self.vocab, self.context, self.channels = device, vocab, context, channels
        self.params = (("wte", (vocab, channels)), ("wpe", (context, channels)))

    def bind(self, flat):
        self.wte, self.wpe = flat.param_view("wte"), flat.param_view("wpe")
        self.dwte, self.dwpe = flat.grad_view("wte"), flat.grad_view("wpe")

    def activation_shapes(self, B, T) -> list:
        return [(B, T, self.channels)]             # the output, the first block's input

    def forward(self, tokens):                      # tokens (B, T) int -> (N, C)
        B, T = tokens.shape
        self.tokens = tokens
        # the residual stream starts here: in full precision (float32 under a 16-bit compute dtype,
        # as autocast keeps it: each block's branch adds its rounded output to it)
        out = self._buffer("out", (B, T, self.channels), self.device.accum_dtype)
        self.device.ops.embedding_forward(tokens, self.wte, self.wpe, out)
        return out.reshape(B * T, self.channels)

    def backward(self, dout, accumulate=False):     # dout (N, C); dwte ADDS to the tied head's gradient
        B, T = self.tokens.shape
        self.device.ops.embedding_backward(dout.reshape(B, T, self.channels), self.tokens, self.dwte, self.dwpe,
                                           accumulate)


class LayerNorm(Layer):
    """y = (x - mean) / sqrt(var + eps) * weight + bias per row; mean and rstd kept for backward."""

    def __init__(self, device, name: str, channels: int, eps: float = 1e-5):
        self.device, self.name, self.channels, self.eps = device, name, channels, eps
        self.params = ((f"{name}.weight", (channels,)), (f"{name}.bias", (channels,)))
        self._done_for = None  # the input whose output :meth:`forward_sum` has already computed

    def bind(self, flat):
        self.w, self.b = (flat.param_view(n) for n, _ in self.params)
        self.dw, self.db = (flat.grad_view(n) for n, _ in self.params)

    def activation_shapes(self, n) -> list:
        return [(n,), (n,), (n, self.channels)]    # mean, rstd, the output

    def forward(self, x):                           # x (N, C) -> (N, C)
        if self._done_for is x:  # the block before computed it, fused into its residual add
            self._done_for = None
            return self._buffer("out", x.shape)
        n = x.shape[0]
        self.x = x
        self.mean, self.rstd = self._stats(n)
        out = self._buffer("out", x.shape)
        return self.device.ops.layernorm_forward(x, self.w, self.b, out, self.mean, self.rstd, self.eps)

    def forward_sum(self, a, b, x, ahead=False):   # x (N, C) <- a + b, then forward(x), in one op
        """A pre-LN block's residual add fused into the LayerNorm after it (one kernel on a GPU, the
        same bits as the add then :meth:`forward`); x is the sum, kept as this layer's input.
        ``ahead``: computed by the block before this layer's own (a block's output add with the next
        block's ln_1, or ln_f): the next :meth:`forward` of that same x returns it as it is."""
        n = x.shape[0]
        self.x = x
        self.mean, self.rstd = self._stats(n)
        out = self._buffer("out", x.shape)
        self._done_for = x if ahead else None
        return self.device.ops.residual_layernorm_forward(a, b, x, self.w, self.b, out, self.mean, self.rstd,
                                                          self.eps)

    def _stats(self, n):
        """The rows' mean and rstd, kept for backward in the device's full precision (float32 under a
        16-bit compute dtype, :mod:`hpctrain.precision`)."""
        accum = self.device.accum_dtype
        return self._buffer("mean", (n,), accum), self._buffer("rstd", (n,), accum)

    def backward(self, dout, dx, accumulate=False, add_dx=False):
        """dx (N, C) <- (or, with add_dx, +=) the input gradient: a pre-LN block adds its branch's
        input gradient to the residual stream's."""
        return self.device.ops.layernorm_backward(dout, self.x, self.w, self.mean, self.rstd, dx, self.dw,
                                                  self.db, accumulate, add_dx)


class CausalSelfAttention(Layer):
    """QKV projection -> causal multi-head attention -> output projection (no parameters of its own
    besides the two Linears). Keeps qkv (N, 3C), the attention output (B, T, C) and what the
    device's attention saves for backward (``attention_state_shapes``: the softmax probabilities
    (B, NH, T, T) on the CPU, one log-sum-exp per row (B, NH, T) on a GPU).
    ``workspace``: a dict the layers of one model share for backward's work array (layers run
    backward one at a time, so one array serves them all). ``tensor`` (a
    :class:`~.tensor_parallel.TensorGroup` of t ranks): this rank computes n_head / t heads:
    c_attn holds their q, k and v columns (C, 3 C / t), c_proj the matching rows (C / t, C),
    and forward all-reduces c_proj's output; backward returns a partial input gradient, which
    the caller all-reduces (:class:`Block`)."""

    def __init__(self, device, name: str, channels: int, n_head: int, workspace: dict | None = None,
                 tensor=None):
        t = 1 if tensor is None else tensor.size
        self.device, self.name, self.channels, self.n_head = device, name, channels, n_head // t
        self.local = channels // t   # this rank's channels of q, k, v and of the attention output
        self.workspace = {} if workspace is None else workspace
        self.c_attn = Linear(device, f"{name}.c_attn", channels, 3 * self.local)
        self.c_proj = (Linear(device, f"{name}.c_proj", channels, channels) if tensor is None else
                       RowParallelLinear(device, f"{name}.c_proj", self.local, channels, tensor))
        self.params = self.c_attn.params + self.c_proj.params

    def bind(self, flat):
        self.c_attn.bind(flat)
        self.c_proj.bind(flat)

    def activation_shapes(self, B, T) -> list:
        """qkv and the projection's output (the Linears'), the attention output, the saved state."""
        N, C = B * T, self.local
        saved, _ = self.device.ops.attention_state_shapes(B, self.n_head, T)
        return [*self.c_attn.activation_shapes(N), (B, T, C), saved, *self.c_proj.activation_shapes(N)]

    def forward(self, x, B: int, T: int):           # x (N, C) -> (N, C)
        C, NH = self.local, self.n_head
        self.B, self.T = B, T
        self.qkv = self.c_attn.forward(x)
        y = self._buffer("y", (B, T, C))
        saved, self._work_shape = self.device.ops.attention_state_shapes(B, NH, T)
        # the CPU twin's probabilities are an activation (in the compute dtype); the GPU's
        # log-sum-exps are statistics (full precision)
        ops = self.device.ops
        self.saved = self._buffer("saved", saved, None if ops.attention_saved_kind == "probabilities" else
                                  self.device.accum_dtype)
        self.y = y
        self.device.ops.attention_forward(self.qkv.reshape(B, T, 3 * C), NH, y, self.saved)
        return self.c_proj.forward(y.reshape(B * T, C))

    def backward(self, dout, accumulate=False):     # dout (N, C) -> dx (N, C), partial under tensor parallelism
        B, T, C = self.B, self.T, self.local
        dy = self.c_proj.backward(dout, accumulate)
        dqkv = self._buffer("dqkv", (B, T, 3 * C))
        self.device.ops.attention_backward(dy.reshape(B, T, C), self.qkv.reshape(B, T, 3 * C), self.y, self.saved,
                                           self.n_head, dqkv, self._work(self._work_shape))
        return self.c_attn.backward(dqkv.reshape(B * T, 3 * C), accumulate)

    def _work(self, shape):
        work = self.workspace.get(shape)
        if work is None:
            work = self.workspace[shape] = self.device.empty(shape, self.device.accum_dtype)  # not kept
        return work


class Block(Layer):
    """x + attn(ln_1(x)), then + mlp(ln_2(.)): GPT-2's pre-LN block; the MLP is Linear 4C -> GELU -> Linear C.

    ``shared`` (activation recomputation, ``model.recompute``): None, every layer of the block
    keeps its own arrays ("none"). A dict ("blocks"): the block and its layers take their arrays
    (activations and backward's gradients) from it by role (``.ln_1``, ``.attn.c_attn``, ...), so
    the blocks given one dict share one block's worth; forward then keeps only a reference to its
    input, and backward first re-runs the forward from it (the same kernels in the same order, so
    the same bits; all but the MLP's output GEMM and the last residual add, whose results backward
    never reads) before its own work. The block whose forward ran last (the top one, whose
    backward comes first) finds its arrays still there and re-runs nothing: the dict records, per
    shape, which block's activations its arrays hold. The output is the block's own either way:
    it is the next block's saved input (or ln_f's), and a shared one would be overwritten by that
    block's forward.

    ``tensor`` (a :class:`~.tensor_parallel.TensorGroup` of t ranks): the attention as
    :class:`CausalSelfAttention` says, the MLP's c_fc split by columns (C, 4 C / t) and its
    c_proj by rows (4 C / t, C); the LayerNorms are replicated. Each branch's partial input
    gradient is all-reduced before its LayerNorm's backward, so the residual stream and its
    gradient are the same on every tensor rank.
    """

    def __init__(self, device, name: str, channels: int, n_head: int, workspace: dict | None = None,
                 shared: dict | None = None, tensor=None):
        self.device, self.name, C = device, name, channels
        self.tensor = tensor
        hidden = 4 * C // (1 if tensor is None else tensor.size)
        self.ln_1 = LayerNorm(device, f"{name}.ln_1", C)
        self.attn = CausalSelfAttention(device, f"{name}.attn", C, n_head, workspace, tensor)
        self.ln_2 = LayerNorm(device, f"{name}.ln_2", C)
        self.c_fc = Linear(device, f"{name}.mlp.c_fc", C, hidden, activation="gelu")
        self.c_proj = (Linear(device, f"{name}.mlp.c_proj", hidden, C) if tensor is None else
                       RowParallelLinear(device, f"{name}.mlp.c_proj", hidden, C, tensor))
        # the LayerNorm after this block (the next block's ln_1, or ln_f; set by the model): the
        # block's output add is fused into it, so the output is normalised as it is formed
        self.next_norm = None
        # the parts in forward order, each reading only its own parameters (but the fused next_norm)
        self.parts = (self.ln_1, self.attn, self.ln_2, self.c_fc, self.c_proj)
        self.params = tuple(p for part in self.parts for p in part.params)
        # ZeRO-3 (set by the model before each pass; None: the caller brackets the whole block):
        # before(params, forward) as a part is about to read ``params`` (in backward, also to write
        # their gradients); after(params) once backward has written a part's gradients
        self.before = self.after = None
        self._outputs = {}  # the output per shape, never shared
        self.recompute = shared is not None
        if self.recompute:
            for layer in self.layers():
                layer.cache = shared.setdefault(layer.name[len(name):], {})
            # shape -> the block whose activations the shared arrays of that shape hold (a key no
            # layer's role can be: roles are "" or start with ".")
            self._holder = shared.setdefault("holder", {})

    def layers(self) -> tuple:
        """The block and the layers inside it: everything that caches arrays (:attr:`Layer.cache`)."""
        return (self, self.ln_1, self.attn, self.attn.c_attn, self.attn.c_proj, self.ln_2, self.c_fc, self.c_proj)

    def bind(self, flat):
        for part in self.parts:
            part.bind(flat)

    def activation_shapes(self, B, T) -> list:
        """What forward keeps in :meth:`layers`' caches (shared with ``shared``): everything but the
        output, an (N, C) array of the block's own."""
        N, C = B * T, self.c_proj.n_out
        return [*self.ln_1.activation_shapes(N), *self.attn.activation_shapes(B, T), (N, C),  # (N, C): mid
                *self.ln_2.activation_shapes(N), *self.c_fc.activation_shapes(N), *self.c_proj.activation_shapes(N)]

    def forward(self, x, B: int, T: int):           # x (N, C) residual stream in -> out (N, C)
        self.x, self.B, self.T = x, B, T            # what a recompute starts from
        mid, h = self._to_hidden(x, B, T)
        if self.recompute:
            self._holder[x.shape] = self
        out = self._outputs.get(x.shape)
        if out is None:   # the residual stream: full precision (hpctrain.precision)
            out = self._outputs[x.shape] = self.device.empty(x.shape, self.device.accum_dtype)
        self._before(self.c_proj, True)
        y = self.c_proj.forward(h)
        if self.next_norm is None:
            return self.device.ops.residual_forward(mid, y, out)
        self.next_norm.forward_sum(mid, y, out, ahead=True)
        return out

    def _to_hidden(self, x, B, T):
        """The forward up to the MLP's hidden activation: mid = x + attn(ln_1(x)) (N, C), the
        second LayerNorm's input, and h = gelu(c_fc(ln_2(mid))) (N, 4C)."""
        mid = self._buffer("mid", x.shape, self.device.accum_dtype)   # the residual stream
        self._before(self.ln_1, True)
        a = self.ln_1.forward(x)
        self._before(self.attn, True)
        a = self.attn.forward(a, B, T)
        self._before(self.ln_2, True)
        normed = self.ln_2.forward_sum(x, a, mid)
        self._before(self.c_fc, True)
        return mid, self.c_fc.forward(normed)

    def _before(self, part, forward: bool) -> None:
        if self.before is not None:
            self.before(part.params, forward)

    def _after(self, part) -> None:
        if self.after is not None:
            self.after(part.params)

    def backward(self, dres, accumulate=False):
        """``dres`` (N, C): d loss / d (this block's output) in, d loss / d (its input) out, in place:
        each residual branch's input gradient is added to it by its LayerNorm."""
        if self.recompute and self._holder.get(self.x.shape) is not self:
            # the shared arrays hold another block's activations (the last forward's) or, after
            # the block above's backward, nobody's: rebuild ours from the saved input. Backward reads neither the MLP's output projection
            # (identity: only its input) nor the block's output, so those two ops are not re-run.
            self.c_proj.keep_input(self._to_hidden(self.x, self.B, self.T)[1])
        self._before(self.c_proj, False)
        dh = self.c_proj.backward(dres, accumulate)
        self._after(self.c_proj)
        self._before(self.c_fc, False)
        dx = self.c_fc.backward(dh, accumulate)
        self._after(self.c_fc)
        self._before(self.ln_2, False)
        self.ln_2.backward(self._summed(dx), dres, accumulate, add_dx=True)
        self._after(self.ln_2)
        self._before(self.attn, False)
        dx = self.attn.backward(dres, accumulate)
        self._after(self.attn)
        self._before(self.ln_1, False)
        self.ln_1.backward(self._summed(dx), dres, accumulate, add_dx=True)
        self._after(self.ln_1)
        if self.recompute:
            # backward may have written over activations in place: the arrays hold nobody's now
            self._holder.pop(self.x.shape, None)
        return dres

    def _summed(self, dx):
        """A column-split layer's input gradient is this rank's part of a sum: add the others'."""
        return dx if self.tensor is None else self.tensor.allreduce(dx)


class TiedTable(Layer):
    """The token table ``wte`` (V, C) alone: the tied head's weight on a pipeline's last stage, which
    holds no embedding (its copy of the first stage's table, kept equal by summing their gradients)."""

    def __init__(self, device, vocab: int, channels: int):
        self.device, self.vocab = device, vocab
        self.params = (("wte", (vocab, channels)),)

    def bind(self, flat):
        self.wte, self.dwte = flat.param_view("wte"), flat.grad_view("wte")


class TiedHead(Layer):
    """logits (N, V) = x (N, C) @ wte^T, with the embedding's own table (no parameters of its own;
    ``embedding``: the :class:`Embedding`, or a :class:`TiedTable` on a pipeline's last stage)."""

    def __init__(self, device, embedding: Embedding):
        self.device, self.embedding = device, embedding

    def activation_shapes(self, n) -> list:
        return [(n, self.embedding.vocab)]         # the logits

    def forward(self, x):
        self.x = x
        logits = self._buffer("logits", (x.shape[0], self.embedding.vocab))
        return self.device.ops.tied_head_forward(x, self.embedding.wte, logits)

    def backward(self, dlogits, accumulate=False):  # writes (or adds) dwte first of all its users
        dx = self._buffer("dx", self.x.shape)
        return self.device.ops.tied_head_backward(dlogits, self.x, self.embedding.wte, dx, self.embedding.dwte,
                                                  accumulate)


def gpt2_init(rng: np.random.Generator, name: str, shape: tuple, n_layer: int) -> np.ndarray:
    """GPT-2's initial value of parameter ``name`` in float64: normal(0, 0.02) for matrices and
    embeddings, the residual projections (``*.c_proj.weight``) scaled by 1/sqrt(2 n_layer),
    zero biases, LayerNorm weights one."""
    leaf = name.rsplit(".", 1)[-1]
    if name.startswith("h.") and (".ln_1." in name or ".ln_2." in name) or name.startswith("ln_f."):
        return np.ones(shape) if leaf == "weight" else np.zeros(shape)
    if leaf == "bias":
        return np.zeros(shape)
    std = 0.02 / np.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
    return rng.normal(0.0, std, shape)
