"""The layers a GPT rank runs: all of them, or one pipeline stage's, for one micro-batch at a time.

A :class:`StageSpan` says which part of the model a rank holds: blocks [lo, hi) of n_layer, the
embedding when it is the first stage, ln_f, the tied head and the loss when it is the last (one
stage, the whole model, without pipeline parallelism). :class:`GPTLayers` builds that part's
layers and runs its forward and backward:

    first stage:  tokens -> embedding -> its blocks -> the residual stream (N, C), sent on
    middle:       the stream received -> its blocks -> sent on
    last stage:   the stream received -> its blocks -> ln_f -> logits (x @ wte^T) -> the loss

and backward the other way, the residual stream's gradient ``dres`` updated in place block by block
and, on every stage but the first, sent back. A layer keeps what its backward needs from its last
forward, so a stage with several micro-batches in flight (a pipeline schedule) runs each on its own
:class:`GPTLayers`, a *lane*: the lanes of a model share its parameters and gradients (one flat
buffer), backward's attention work array and, with ``model.recompute = "blocks"``, the one set of
block arrays that backward rebuilds; each keeps its own activations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..nn.layers import SoftmaxCrossEntropy
from ..nn.transformer import Block, Embedding, LayerNorm, TiedHead, TiedTable


@dataclass(frozen=True)
class StageSpan:
    """Stage ``index`` of ``count`` holds blocks [lo, hi); ``counts``: every stage's block count."""

    index: int
    count: int
    lo: int
    hi: int
    counts: tuple = ()

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @classmethod
    def of(cls, counts: list, index: int) -> "StageSpan":
        """Stage ``index`` of a split with ``counts`` blocks per stage."""
        lo = sum(counts[:index])
        return cls(index, len(counts), lo, lo + counts[index], tuple(counts))


class GPTLayers:
    """One lane of ``model``'s layers (see the module docstring): built over ``model``'s span,
    device and tensor group; ``workspace`` and ``shared`` are the model's (shared by its lanes)."""

    def __init__(self, model, workspace: dict, shared: dict | None):
        dev, span, C = model.device, model.span, model.d_model
        self.model = model
        self.embedding = Embedding(dev, model.vocab, model.context, C) if span.first else None
        # the tied head's table: the embedding's, or a copy of it on a later last stage
        self.table = self.embedding if span.first else TiedTable(dev, model.vocab, C) if span.last else None
        self.blocks = [Block(dev, f"h.{i}", C, model.n_head, workspace, shared, model.tensor)
                       for i in range(span.lo, span.hi)]
        self.ln_f = LayerNorm(dev, "ln_f", C) if span.last else None
        for block, after in zip(self.blocks, [*(b.ln_1 for b in self.blocks[1:]), self.ln_f]):
            block.next_norm = after  # each block's output add fused into the LayerNorm that reads it
        self.head = TiedHead(dev, self.table) if span.last else None
        self.loss = SoftmaxCrossEntropy(dev, model.prediction_weight) if span.last else None
        self.by_part = False   # ZeRO-3 (separate): blocks fetch and claim part by part

    def separate(self) -> None:
        """ZeRO-3: each part of a block reads only its own parameters, and says so before it runs
        (:meth:`_part_hooks`): no block computes the LayerNorm after it fused into its output add (the
        same bits), and each block's parts fetch, claim and release their parameters one part at a time."""
        self.by_part = True
        for block in self.blocks:
            block.next_norm = None

    @property
    def holders(self) -> list:
        """The layers that own parameters, in the flat buffer's order."""
        return [x for x in (self.table, *self.blocks, self.ln_f) if x is not None]

    def specs(self) -> list:
        """(name, shape) of the lane's parameters in flat order: the table(s), then per block its
        matrices before its vectors (two weight-decay runs per block), then ln_f."""
        specs = list(self.table.params) if self.table is not None else []
        for block in self.blocks:
            specs += [p for p in block.params if len(p[1]) == 2] + [p for p in block.params if len(p[1]) == 1]
        return specs + (list(self.ln_f.params) if self.ln_f is not None else [])

    @property
    def layer_units(self) -> list:
        """The parameter names of each bucket under ``dist.bucket_split = "layers"`` (ZeRO-3's gather
        units), in flat order: the token table alone (a pipeline sums it between stages), the position
        table; per block its attention's two matrices (3 C^2 + C^2), the MLP's c_fc and c_proj matrices
        (4 C^2 each) and its vectors (small: ZeRO-3 keeps them gathered); ln_f. (In backward a block's
        vectors are final last, after its matrices' buckets of higher index: the reducers take buckets
        in the order they become ready.)"""
        units = [(name,) for name, _ in self.table.params] if self.table is not None else []
        for b in self.blocks:
            units += [(b.attn.c_attn.params[0][0], b.attn.c_proj.params[0][0]),
                      (b.c_fc.params[0][0],), (b.c_proj.params[0][0],),
                      tuple(n for n, shape in b.params if len(shape) == 1)]
        return units + ([tuple(n for n, _ in self.ln_f.params)] if self.ln_f is not None else [])

    def bind(self, flat) -> None:
        for layer in self.holders:
            layer.bind(flat)

    def forward(self, inp, B: int, T: int, fetch=None):
        """The span's forward of one micro-batch: ``inp`` the tokens (B, T) on the first stage, else
        the residual stream (B*T, C) the stage before sent. Returns the logits (B*T, V) on the last
        stage, else the residual stream to send on (an array of this lane's own). ``fetch``: ZeRO-3's,
        called before a layer reads the parameters it names (None: they are all here)."""
        tr, rg = self.model.tracer, self.model.ranges
        if self.embedding is not None:
            _fetch(fetch, self.embedding.params, True)
            x = self.embedding.forward(inp)
        else:
            x = inp
        before, _ = self._part_hooks(fetch=fetch)
        for block in self.blocks:
            t0 = tr and time.perf_counter()
            if before is None:
                _fetch(fetch, _forward_reads(block), True)
            block.before, block.after = before, None
            if rg is not None:
                rg.push(f"forward {block.name}")
            x = block.forward(x, B, T)
            if rg is not None:
                rg.pop()
            if tr is not None:
                tr.complete(f"forward {block.name}", t0, "layer", sync=True)
        if self.head is None:
            return x
        _fetch(fetch, self.ln_f.params, True)
        x = self.ln_f.forward(x)
        _fetch(fetch, (("wte", None),), True)
        return self.head.forward(x)

    def backward(self, dres, accumulate=False, ready=None, claim=None, fetch=None):
        """The span's backward of the micro-batch of this lane's last forward; ``dres`` (N, C), in the
        device's full precision: written here on the last stage (the loss's gradient through the
        head and ln_f), else holding the gradient of the span's output; on return it holds the
        gradient of the span's input (what a stage sends back). Parameter gradients are written, or
        added with ``accumulate``. ``ready(name)`` per parameter once final: ln_f, the blocks top
        down, the table(s) last; ``claim(names)`` before each layer writes gradients; ``fetch`` as in
        :meth:`forward`."""
        tr, rg = self.model.tracer, self.model.ranges
        if self.head is not None:
            _claim(claim, (("wte", None),))
            _fetch(fetch, (("wte", None),), False)
            dxf = self.head.backward(self.loss.backward(), accumulate)
            _claim(claim, self.ln_f.params)
            _fetch(fetch, self.ln_f.params, False)
            self.ln_f.backward(dxf, dres, accumulate, add_dx=False)
            _ready(ready, self.ln_f.params)
        before, after = self._part_hooks(claim, ready, fetch)
        for block in reversed(self.blocks):
            t0 = tr and time.perf_counter()
            if before is None:
                _claim(claim, block.params)
                _fetch(fetch, block.params, False)
            block.before, block.after = before, after
            if rg is not None:
                rg.push(f"backward {block.name}")
            block.backward(dres, accumulate)
            if rg is not None:
                rg.pop()
            if tr is not None:
                tr.complete(f"backward {block.name}", t0, "layer", sync=True)
            if before is None:
                _ready(ready, block.params)
        if self.embedding is not None:   # (its backward reads no parameters: nothing to fetch)
            _claim(claim, self.embedding.params)
            if self.head is None and not accumulate:   # the embedding adds to the table's gradient, which
                self.model.device.ops.fill(self.embedding.dwte, 0)   # the head writes first where it is here
            self.embedding.backward(dres, accumulate)
        if self.table is not None:   # the head's table is final once the embedding (if here) added to it
            _ready(ready, self.table.params if self.embedding is None else self.embedding.params)
        return dres

    def _part_hooks(self, claim=None, ready=None, fetch=None):
        """(before, after) for the blocks' parts under ZeRO-3 (:attr:`by_part`; else (None, None): the
        caller fetches, claims and releases whole blocks): ``before(params, forward)`` fetches a
        part's parameters, and in backward first claims their gradients; ``after(params)`` says they
        are final (``ready``, when given)."""
        if not self.by_part:
            return None, None

        def before(params, forward: bool) -> None:
            names = [name for name, _ in params]
            if not forward and claim is not None:
                claim(names)
            if fetch is not None:
                fetch(names, forward)

        def after(params) -> None:
            if ready is not None:
                for name, _ in params:
                    ready(name)

        return before, after

    def held(self) -> list:
        """The activation arrays this lane holds (what :meth:`~hpctrain.models.gpt.GPT.activation_bytes`
        counts, made so far): its layers' cached arrays but backward's gradients (keys "d..."), and
        the blocks' outputs."""
        layers = [x for x in (self.embedding, *(part for b in self.blocks for part in b.layers()), self.ln_f,
                              self.head, self.loss) if x is not None]
        caches = {id(layer.cache): layer.cache for layer in layers if layer.cache is not None}
        arrays = [a for cache in caches.values() for (key, _), a in cache.items() if not key.startswith("d")]
        return arrays + [out for b in self.blocks for out in b._outputs.values()]

    @property
    def forward_groups(self) -> list:
        """The parameter names forward fetches (ZeRO-3), in its order: the embedding's, each block's,
        ln_f's, the head's table."""
        names = lambda params: tuple(n for n, _ in params)  # noqa: E731
        blocks = ([names(part.params) for b in self.blocks for part in b.parts] if self.by_part else
                  [names(_forward_reads(b)) for b in self.blocks])
        return [*([names(self.embedding.params)] if self.embedding is not None else []), *blocks,
                *([names(self.ln_f.params), ("wte",)] if self.head is not None else [])]

    @property
    def backward_groups(self) -> list:
        """The parameter names each ``claim`` of :meth:`backward` names, in its order."""
        names = lambda layer: tuple(n for n, _ in layer.params)  # noqa: E731
        head = [("wte",), names(self.ln_f)] if self.head is not None else []
        blocks = ([names(part) for b in reversed(self.blocks) for part in reversed(b.parts)] if self.by_part else
                  [names(b) for b in reversed(self.blocks)])
        return [*head, *blocks,
                *([names(self.embedding)] if self.embedding is not None else [])]


def _claim(claim, params):
    if claim is not None:
        claim([name for name, _ in params])


def _forward_reads(block) -> tuple:
    """The parameters a block's forward reads: its own, and the LayerNorm after it (the next block's
    ln_1 or ln_f), into which its output add is fused."""
    return block.params + (block.next_norm.params if block.next_norm is not None else ())


def _fetch(fetch, params, forward: bool):
    if fetch is not None:
        fetch([name for name, _ in params], forward)


def _ready(ready, params):
    if ready is not None:
        for name, _ in params:
            ready(name)
