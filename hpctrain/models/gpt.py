"""A GPT-2 language model (decoder-only, pre-LayerNorm) on the token format.

    tokens (B, T) -> wte[token] + wpe[t] -> n_layer x Block -> ln_f -> logits = x @ wte^T (tied)
    loss = mean over the B*T positions of cross-entropy(logits, next token)

No dropout. Initial weights as GPT-2 (:func:`~hpctrain.nn.transformer.gpt2_init`). The flat
buffer holds wte, wpe, then per block its four matrices before its eight vectors (so weight
decay, which skips biases and LayerNorm parameters, is two runs per block), then ln_f.
Checkpoint paths follow the names: /model/h/<i>/attn/c_attn/weight is (C, 3C), (in, out) like
GPT-2's own Conv1D weights. ``model.recompute = "blocks"`` makes the blocks share one block's
activation arrays and rebuild them in backward from each block's saved input
(:class:`~hpctrain.nn.transformer.Block`); :meth:`GPT.activation_bytes` counts what is kept.

The family functions (:mod:`hpctrain.models`): :func:`~hpctrain.models.gpt_data.open_data` opens
``data.train``'s /train stream as windows of ``model.context + 1`` tokens and the /val stream (of
``data.eval`` when set) for evaluation; :func:`build` makes the :class:`GPT` for the file's vocabulary.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError
from ..nn.flat import FlatParams
from ..nn.tensor_parallel import TensorLayout
from ..nn.transformer import gpt2_init
from . import TrainingData
from .gpt_data import open_data
from .gpt_layers import GPTLayers, StageSpan
from .stage_split import balance

# the family functions (hpctrain.models: open_data is gpt_data's), the model, and the stage balance
__all__ = ["open_data", "build", "GPT", "stage_blocks", "TENSOR_SPLITS"]

GPT_OPS = ("embedding_forward", "attention_forward", "layernorm_forward", "residual_forward")


def build(cfg, device, data: TrainingData, tensor=None, stage: int = 0, *, row_weight=None, tracer=None,
          ranges=None) -> "GPT":
    """``tensor``: the :class:`~hpctrain.nn.tensor_parallel.TensorGroup` that splits each block
    (``dist.tensor_parallel`` > 1), or None; ``stage``: this rank's pipeline stage of
    ``dist.pipeline_parallel`` (its blocks from ``dist.pipeline_stages``, or balanced);
    ``row_weight``, ``tracer``, ``ranges``: as the family interface says (:mod:`hpctrain.models`).
    Under ``dist.zero = 3`` the model gets no whole parameter or gradient buffer (ZeRO-3 gives it
    its pools)."""
    m = cfg.model
    missing = [op for op in GPT_OPS if not hasattr(device.ops, op)]
    if missing:
        raise ConfigError(f"model.kind = \"gpt\" has no {device.name} kernels yet ({', '.join(missing)}); "
                          f"train it with --set train.device=cpu")
    limit = device.ops.attention_max_head_size   # the device's kernels' own limit (None: none)
    if limit and m.n_head and m.d_model % m.n_head == 0 and m.d_model // m.n_head > limit:
        raise ConfigError(f"model.d_model / model.n_head = {m.d_model // m.n_head} is a head size above the "
                          f"{device.name.upper()} attention kernels' limit of {limit}; use more heads "
                          f"(model.n_head >= {-(-m.d_model // limit)}), model.attention='auto' or 'gemm' (cuBLAS "
                          f"through CuPy) or train.device=cpu")
    vocab, p = data.info["vocab_size"], cfg.dist.pipeline_parallel
    counts = stage_blocks(m, p, cfg.dist.pipeline_stages, vocab, cfg.dist.pipeline_balance)
    return GPT(device, vocab, m.context, m.n_layer, m.n_head, m.d_model, m.recompute, tensor,
               StageSpan.of(counts, stage), allocate=cfg.dist.zero != 3, row_weight=row_weight, tracer=tracer,
               ranges=ranges)


def stage_blocks(m, p: int, counts: list, vocab: int, by: str = "parameters") -> list[int]:
    """Blocks per pipeline stage: ``counts`` as given, or balanced
    (:func:`~.stage_split.balance`) by ``by``:

    - ``"parameters"``: each block's parameters, the embedding's tables (wte, wpe) on the first stage,
      the tied table's copy and ln_f on the last;
    - ``"compute"``: model FLOPs per token of forward + backward as :attr:`GPT.flops_per_row` counts
      them: a block's 6 x 12 C^2 (its four matrices) + 12 T C (attention's two T x T products), the
      last stage's head 6 V C; the first stage's lookup counted as free (no matrix product).
      The elementwise work (LayerNorms, GELU, softmax, the loss) is not counted: on a CPU it makes
      the head's share a little larger than its FLOPs say."""
    if counts:
        return list(counts)
    C, T = m.d_model, m.context
    if by == "compute":
        return balance(m.n_layer, p, 6 * 12 * C * C + 12 * T * C, 0, 6 * vocab * C)
    return balance(m.n_layer, p, 12 * C * C + 13 * C, (vocab + m.context) * C, vocab * C + 2 * C)


# Tensor parallelism splits these parameters of every block: name suffix -> (axis, parts). The
# QKV matrix's columns are q, k and v (three parts), each cut by heads; the output projections
# are cut by rows; the rest (embeddings and the tied head, LayerNorms, the projections' biases)
# is replicated: the byte-level vocabulary (256 x d_model) is smaller than one block's matrices,
# and a vocabulary split would need its own all-reduces in the cross-entropy for no memory worth having.
TENSOR_SPLITS = {"attn.c_attn.weight": (1, 3), "attn.c_attn.bias": (0, 3), "attn.c_proj.weight": (0, 1),
                 "mlp.c_fc.weight": (1, 1), "mlp.c_fc.bias": (0, 1), "mlp.c_proj.weight": (0, 1)}


def _tensor_split(name: str):
    """(axis, parts) of parameter ``name`` under tensor parallelism, or None (replicated):
    "h.<i>.attn.c_attn.weight" is split as TENSOR_SPLITS's "attn.c_attn.weight"."""
    return TENSOR_SPLITS.get(name.split(".", 2)[-1]) if name.startswith("h.") else None


class GPT:
    """The model behind the family interface (:mod:`hpctrain.models`).

    ``tensor`` (a :class:`~hpctrain.nn.tensor_parallel.TensorGroup`, or None): the blocks are
    split over its t ranks (:data:`TENSOR_SPLITS`); ``flat`` then holds this rank's pieces, and
    ``tensor_layout`` maps them to the logical arrays (initial weights, checkpoints).
    ``span`` (a :class:`~.gpt_layers.StageSpan`; default the whole model): the pipeline stage this
    rank holds; ``flat`` then holds that stage's parameters, and :meth:`lane` gives more sets of
    its layers for micro-batches in flight together (:mod:`.gpt_layers`). :meth:`forward`,
    :meth:`backward` and :meth:`logits` run the whole model (one stage)."""

    input_dtype = np.int64  # token ids

    def __init__(self, device, vocab: int, context: int, n_layer: int, n_head: int, d_model: int,
                 recompute: str = "none", tensor=None, span: StageSpan | None = None, allocate: bool = True,
                 row_weight: float | None = None, tracer=None, ranges=None):
        if d_model % n_head:
            raise ConfigError(f"model.n_head={n_head} does not divide model.d_model={d_model}")
        if tensor is not None and n_head % tensor.size:
            raise ConfigError(f"dist.tensor_parallel={tensor.size} does not divide model.n_head={n_head}")
        if recompute not in ("none", "blocks"):
            raise ConfigError(f"model.recompute={recompute!r}: choose none or blocks")
        self.device, self.vocab, self.context, self.n_layer, self.d_model = device, vocab, context, n_layer, d_model
        self.n_head, self.recompute = n_head, recompute
        self.targets_per_row = context
        self.span = span or StageSpan(0, 1, 0, n_layer)
        if not 0 <= self.span.lo < self.span.hi <= n_layer:
            raise ConfigError(f"pipeline stage {self.span.index} would hold blocks {self.span.lo}..{self.span.hi - 1} "
                              f"of model.n_layer={n_layer}: every stage holds at least one block")
        self.tensor = tensor
        self.tracer = tracer  # an hpctrain.observe.trace.Tracer: a span per block in forward and backward
        self.ranges = ranges  # an hpctrain.observe.nvtx.NvtxRanges (train.nvtx): the same as NVTX ranges
        # the loss's weight of one prediction: a row's weight shared by its context's predictions
        self.prediction_weight = None if row_weight is None else float(row_weight / context)
        self._workspace = {}  # backward's attention work array, one for all blocks and lanes
        # with recompute = "blocks", one block's arrays for all blocks (and lanes), rebuilt in backward
        self._shared = {} if recompute == "blocks" else None
        self._lanes = [GPTLayers(self, self._workspace, self._shared)]
        self.flat = FlatParams(device, self._lanes[0].specs(), allocate)
        self.no_decay = frozenset(s.name for s in self.flat.slots if len(s.shape) == 1)
        # the QKV weight is three matrices side by side (q, k, v; so on every tensor rank too):
        # PowerSGD approximates each on its own instead of sharing one row space among them
        self.matrix_parts = {s.name: 3 for s in self.flat.slots if s.name.endswith("attn.c_attn.weight")}
        self.tensor_layout = None if tensor is None else TensorLayout(tensor, {
            s.name: split for s in self.flat.slots if (split := _tensor_split(s.name))})
        self._bind()
        self._dres = {}

    def _bind(self):
        for lane in self._lanes:
            lane.bind(self.flat)

    # the first lane's layers: the ones forward and backward use
    embedding = property(lambda self: self._lanes[0].embedding)
    blocks = property(lambda self: self._lanes[0].blocks)
    ln_f = property(lambda self: self._lanes[0].ln_f)
    head = property(lambda self: self._lanes[0].head)
    loss = property(lambda self: self._lanes[0].loss)

    def lane(self, k: int) -> GPTLayers:
        """The ``k``-th set of this model's layers (0: the one :meth:`forward` uses), made on first use:
        a micro-batch's own activations over the shared parameters (:mod:`.gpt_layers`)."""
        while len(self._lanes) <= k:
            lane = GPTLayers(self, self._workspace, self._shared)
            lane.bind(self.flat)
            if getattr(self, "_separate", False):
                lane.separate()
            self._lanes.append(lane)
        return self._lanes[k]

    def held_activation_bytes(self) -> int:
        """Bytes of the activation arrays every lane holds now (each array once: recomputing lanes
        share one set), the measured side of :meth:`activation_bytes`."""
        return sum({id(a): a.nbytes for lane in self._lanes for a in lane.held()}.values())

    def logical_params(self) -> list:
        """(name, logical shape) of every parameter of the whole model (every stage, unsplit), in
        the order of the flat buffer of a one-stage run: what checkpoints and initial weights cover."""
        whole = GPT.__new__(GPT)
        whole.device, whole.vocab, whole.context, whole.d_model, whole.n_head = (
            self.device, self.vocab, self.context, self.d_model, self.n_head)
        whole.span, whole.tensor, whole.prediction_weight = StageSpan(0, 1, 0, self.n_layer), None, None
        return GPTLayers(whole, {}, None).specs()

    @property
    def flops_per_row(self) -> int:
        """Model FLOPs of one window's forward + backward, as nanoGPT and PaLM count them:
        6 per matrix weight per token (the tied head's V x C included, position embeddings not)
        plus 12 n_layer T C per token for attention's two T x T products (the causal mask's
        saving not subtracted), times T tokens."""
        C, T = self.d_model, self.context   # the whole model's, on every pipeline stage
        matrix = sum(math.prod(shape) for name, shape in self.logical_params() if len(shape) == 2 and name != "wpe")
        return T * (6 * matrix + 12 * self.n_layer * T * C)

    def logical_shape(self, slot) -> tuple:
        """The whole (unsplit) shape of parameter ``slot`` (a :class:`~hpctrain.nn.flat.ParamSlot`)."""
        return slot.shape if self.tensor_layout is None else self.tensor_layout.logical_shape(slot.name, slot.shape)

    def activation_bytes(self, rows: int, in_flight: int = 1) -> int:
        """Bytes of the activation arrays a micro-batch of ``rows`` windows of ``context`` tokens
        keeps from forward to backward on this rank, from the shapes the layers allocate
        (``activation_shapes``): the embedding's output; per block its two LayerNorms' outputs and
        row statistics, qkv, the attention output and what the device's attention saves
        (``attention_state_shapes``: the (B, NH, T, T) probabilities on the CPU, one log-sum-exp
        per row, (B, NH, T), on the CUDA device), both projections' outputs, the residual sum
        between the halves, the MLP's pre-activation and GELU output, and its output; then ln_f's,
        the logits and the loss's probabilities. With ``recompute = "blocks"`` the blocks' arrays
        are one shared set, counted once, and only the outputs (the next block's saved input) are
        per block. Not counted: the token ids (the input), the parameters, and backward's
        gradient arrays (per block with "none", one shared set with "blocks"; the attention's
        work array and the residual stream's gradient are one for all blocks either way).
        A pipeline stage (``span``) counts its own blocks, the embedding's output or the input it
        received, and the head's arrays on the last stage; ``in_flight`` micro-batches held at once
        (its schedule's lanes) each keep their own arrays, but a recomputing stage's one shared set."""
        B, T = rows, self.context
        N, C = B * T, self.d_model
        last, blocks = self.span.last, len(self.blocks)
        # per lane: the embedding's output, or on a later pipeline stage the input it received (the
        # same shape); the head's arrays; each block's output
        own = [(B, T, C)]
        if last:
            own += [*self.ln_f.activation_shapes(N), *self.head.activation_shapes(N),
                    *self.loss.activation_shapes(N, self.vocab)]
        own += [(N, C)] * blocks
        sets = 1 if self.recompute == "blocks" else blocks * in_flight   # over every lane
        shapes = own * in_flight + self.blocks[0].activation_shapes(B, T) * sets
        # the residual stream (the embedding's output, each block's output and its mid-block sum),
        # the LayerNorm statistics and a GPU attention's log-sum-exps are kept in the device's full
        # precision, the rest in its compute dtype (they differ under a 16-bit train.precision)
        low, full = self.device.dtype.itemsize, self.device.accum_dtype.itemsize
        kept_full = (N * C * (1 + blocks) + 2 * N * last) * in_flight + N * C * sets + 4 * N * sets
        if self.device.ops.attention_saved_kind != "probabilities":
            kept_full += math.prod(self.device.ops.attention_state_shapes(B, self.blocks[0].attn.n_head, T)[0]) * sets
        return sum(math.prod(s) for s in shapes) * low + kept_full * (full - low)

    def checkpoint_hint(self, shapes: dict) -> str:
        saved = shapes.get("/model/wte")
        if saved is not None and saved[0] != self.vocab:
            return (f"the checkpoint's vocabulary is {saved[0]} tokens, the data file's is {self.vocab}: train on "
                    f"a token file made the same way as the checkpoint's")
        return ("resume with the model.n_layer, n_head, d_model and context it was saved with (ckpt inspect "
                "shows its config)")

    def use_grad_buffer(self, buf, offsets=None):
        """Keep the gradients in ``buf`` (e.g. the shm all-reduce's window), at ``offsets`` per name
        if given (ZeRO-2, :meth:`FlatParams.use_grad_layout`); every view is rebound."""
        self.flat.use_grad_layout(buf, offsets)
        self._bind()

    def separate_layers(self) -> None:
        """Each layer reads only its own parameters from here on (ZeRO-3, which gathers them layer by
        layer): a block no longer computes the next LayerNorm fused into its output add; the next
        LayerNorm computes it itself (the same bits, one more pass over the residual stream)."""
        self._separate = True
        for lane in self._lanes:
            lane.separate()

    def use_param_buffer(self, buf, offsets):
        """ZeRO-3: read the parameters from ``buf`` at ``offsets`` per name (the gathered slots,
        :meth:`FlatParams.use_param_layout`); every view is rebound."""
        self.flat.use_param_layout(buf, offsets)
        self._bind()

    def init(self, seed: int):
        """GPT-2's initial weights from ``seed``, drawn in float64 in the whole model's flat order,
        one copy to the device. Under tensor parallelism each logical array is drawn whole and this
        rank keeps its piece; a pipeline stage draws every stage's arrays and keeps its own: so
        every t and p starts from the same weights."""
        drawn = dict(self.initial_values(seed))
        host = np.concatenate([drawn[s.name].reshape(-1) for s in self.flat.slots])
        self.device.copy_from_host(self.flat.data, host)

    def initial_values(self, seed: int):
        """(name, float64 host array) of this rank's parameters' initial weights, as :meth:`init`
        draws them (the whole model's arrays in turn, each kept if this rank holds it, its tensor
        piece): one array at a time, so a caller that keeps only its share (ZeRO-3) never holds
        the whole model."""
        rng = np.random.default_rng(seed)
        mine = {s.name for s in self.flat.slots}
        for name, shape in self.logical_params():
            full = gpt2_init(rng, name, shape, self.n_layer)
            if name in mine:
                yield name, self._local(name, full)

    def _local(self, name, full):
        return full if self.tensor_layout is None else self.tensor_layout.local(name, full)

    # ---- forward / backward (the whole model: one stage) -----------------------------
    def logits(self, tokens, fetch=None):
        """(B*T, V) logits of every position of ``tokens`` (B, T), T <= context."""
        B, T = tokens.shape
        if T > self.context:
            raise ValueError(f"{T} positions, more than the model's context {self.context}")
        self.flat.refresh_compute()   # a 16-bit precision's parameter copy, from this step's masters
        return self._lanes[0].forward(tokens, B, T, fetch)

    def forward(self, tokens, targets, totals=None, accumulate=False, *, loss_scale: float = 1.0, fetch=None):
        """(loss_sum, correct) over the B*T next-token predictions of ``tokens`` (B, T); with
        ``totals``, kept on the device as :meth:`~hpctrain.nn.layers.SoftmaxCrossEntropy.forward` says."""
        logits = self.logits(tokens, fetch)
        return self.loss.forward(logits, targets.reshape(-1), totals, accumulate, loss_scale)

    def backward(self, accumulate=False, ready=None, claim=None, fetch=None):
        """d(mean loss)/d(params) into ``flat.grad`` (added with ``accumulate``); ``ready(name)``
        per parameter once final: ln_f, then the blocks top down, then wte and wpe last (the
        tied table gets its second contribution from the embedding). ``claim(names)`` before each
        layer writes gradients: the head (wte), ln_f, each block (under ZeRO-3 each block's parts,
        c_proj first: :attr:`backward_groups`), the embedding (wte, wpe)."""
        self._lanes[0].backward(self.stream_grad(self.ln_f.x.shape), accumulate, ready, claim, fetch)

    def stream_grad(self, shape):
        """The residual stream's gradient (N, C), one array per shape, updated in place block by
        block; in full precision, as the stream itself (hpctrain.precision)."""
        dres = self._dres.get(shape)
        if dres is None:
            dres = self._dres[shape] = self.device.empty(shape, self.device.accum_dtype)
        return dres

    @property
    def forward_groups(self) -> list:
        """The parameter names forward fetches (ZeRO-3), in its order."""
        return self._lanes[0].forward_groups

    @property
    def backward_groups(self) -> list:
        """The parameter names each ``claim`` of :meth:`backward` names, in its order."""
        return self._lanes[0].backward_groups

    @property
    def layer_units(self) -> list:
        """The buckets of ``dist.bucket_split = "layers"`` (:attr:`GPTLayers.layer_units`)."""
        return self._lanes[0].layer_units
