"""hpctrain's GPT written in PyTorch as a PyTorch user writes it (nanoGPT's layout), and a per-op clock.

Shape legend: B batch rows, T positions, C channels (d_model), NH heads, hs = C / NH head size,
V vocabulary.

    tokens (B, T) -> wte[token] + wpe[t] -> n_layer x Block -> ln_f -> logits = x @ wte^T (tied)

Block (GPT-2, pre-LN): x + attn(ln_1(x)), then + mlp(ln_2(.)). attn: c_attn Linear C -> 3C whose
columns are [q | k | v], head h = columns h*hs:(h+1)*hs of each, ``F.scaled_dot_product_attention
(is_causal=True)`` (scale 1/sqrt(hs)), c_proj Linear C -> C; mlp: c_fc Linear C -> 4C,
GELU(approximate="tanh"), c_proj Linear 4C -> C. LayerNorm eps 1e-5, no dropout, no bias on the
head. Parameter names are hpctrain's checkpoint paths with '.' for '/' (``wte``, ``wpe``,
``h.0.attn.c_attn.weight``, ``ln_f.bias``), so :func:`load` is one loop. Imported by
benchmarks/peers/torch_gpt.py after it has set the thread limits (this module imports torch).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

# ---- per-op clock --------------------------------------------------------------------


class OpClock:
    """Seconds per op family in a training step (``train.op_times``), without a profiler.

    Families as hpctrain's ``t_op_*``: gemm (the Linears, bias add included, and the tied head),
    attention (split into heads, SDPA, merge), layernorm, embedding, loss (cross-entropy),
    elementwise (GELU, residual adds); the loop adds optimizer.

    Forward: each op is timed around its call. Backward: an identity autograd node after each
    op's output (:class:`_Stamp`) records when that output's gradient is complete; the autograd
    engine then runs the op's backward (nodes run in reverse creation order when ready, and a
    parameter's AccumulateGrad, with DDP's bucket hook, as soon as its gradient exists), so the
    time from one record to the next is that op's backward. The embedding's backward ends when
    the later of wte and wpe has its gradient accumulated (hooks); the rest of ``backward()`` is
    DDP waiting for its last buckets, ``comm_wait`` (hpctrain's ``t_allreduce``). Cost: two
    ``perf_counter`` calls and one autograd node per op (10 ops per block); ``sync`` (a GPU's
    synchronize) runs at each record. A disabled clock (``enabled=False``) just calls the op.
    """

    def __init__(self, enabled: bool, sync=None):
        self.enabled, self.sync = enabled, sync
        self.totals: dict[str, float] = defaultdict(float)
        self.events: list[tuple[str | None, float]] = []

    def op(self, family: str, fn, *args):
        """``fn(*args)``, timed into ``family`` forward and, through its output, backward."""
        if not self.enabled:
            return fn(*args)
        t0 = time.perf_counter()
        out = fn(*args)
        if self.sync is not None:
            self.sync()
        self.totals[family] += time.perf_counter() - t0
        return _Stamp.apply(out, self, family)

    def mark(self, family: str | None) -> None:
        """A backward record: from now until the next one is ``family``'s."""
        if self.sync is not None:
            self.sync()
        self.events.append((family, time.perf_counter()))

    def watch_last(self, params) -> None:
        """Mark the end of the first op's backward when each of ``params`` has its gradient."""
        if self.enabled:
            for p in params:
                p.register_post_accumulate_grad_hook(lambda _p: self.mark("embedding"))

    def start_backward(self) -> None:
        self.events = [(None, time.perf_counter())]

    def pop(self, backward_end: float) -> dict[str, float]:
        """``{"t_op_<family>": s}`` of the step (forward + backward), and cleared."""
        events = self.events
        for (family, t), (_, t_next) in zip(events, events[1:]):
            if family is not None:
                self.totals[family] += t_next - t
        if len(events) > 1:  # the tail after the last record: DDP's wait for the last buckets
            self.totals["comm_wait"] += backward_end - events[-1][1]
        out = {f"t_op_{k}": v for k, v in self.totals.items()}
        self.totals.clear()
        self.events = []
        return out


class _Stamp(torch.autograd.Function):
    """Identity; its backward records when the gradient of its input is complete."""

    @staticmethod
    def forward(ctx, x, clock, family):
        ctx.clock, ctx.family = clock, family
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.mark(ctx.family)
        return grad, None, None


# ---- the model -----------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, C: int, NH: int, clock: OpClock, dtype):
        super().__init__()
        self.c_attn = nn.Linear(C, 3 * C, dtype=dtype)
        self.c_proj = nn.Linear(C, C, dtype=dtype)
        self.n_head, self.clock = NH, clock

    def forward(self, x):                                      # x (B, T, C)
        op = self.clock.op
        qkv = op("gemm", self.c_attn, x)                       # (B, T, 3C)
        y = op("attention", self.attend, qkv)                  # (B, T, C)
        return op("gemm", self.c_proj, y)

    def attend(self, qkv):
        B, T, C3 = qkv.shape
        C, NH = C3 // 3, self.n_head
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in qkv.split(C, dim=2))  # (B, NH, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)                        # (B, NH, T, hs)
        return y.transpose(1, 2).contiguous().view(B, T, C)


class MLP(nn.Module):
    def __init__(self, C: int, clock: OpClock, dtype):
        super().__init__()
        self.c_fc = nn.Linear(C, 4 * C, dtype=dtype)
        self.c_proj = nn.Linear(4 * C, C, dtype=dtype)
        self.gelu = nn.GELU(approximate="tanh")
        self.clock = clock

    def forward(self, x):                                      # x (B, T, C)
        op = self.clock.op
        return op("gemm", self.c_proj, op("elementwise", self.gelu, op("gemm", self.c_fc, x)))


class Block(nn.Module):
    def __init__(self, C: int, NH: int, clock: OpClock, dtype):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=1e-5, dtype=dtype)
        self.attn = CausalSelfAttention(C, NH, clock, dtype)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5, dtype=dtype)
        self.mlp = MLP(C, clock, dtype)
        self.clock = clock

    def forward(self, x):                                      # residual stream (B, T, C)
        op = self.clock.op
        x = op("elementwise", torch.add, x, self.attn(op("layernorm", self.ln_1, x)))
        return op("elementwise", torch.add, x, self.mlp(op("layernorm", self.ln_2, x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, n_layer: int, n_head: int, C: int, dtype, clock: OpClock):
        super().__init__()
        self.wte = nn.Parameter(torch.empty(vocab, C, dtype=dtype))     # (V, C), also the head's weight
        self.wpe = nn.Parameter(torch.empty(context, C, dtype=dtype))   # (context, C)
        self.h = nn.ModuleList(Block(C, n_head, clock, dtype) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(C, eps=1e-5, dtype=dtype)
        self.clock = clock
        clock.watch_last([self.wte, self.wpe])

    def embed(self, idx):                                      # idx (B, T) -> (B, T, C)
        return F.embedding(idx, self.wte) + self.wpe[:idx.shape[1]]

    def forward(self, idx):                                    # idx (B, T) -> logits (B, T, V)
        op = self.clock.op
        x = op("embedding", self.embed, idx)
        for block in self.h:
            x = block(x)
        return op("gemm", F.linear, op("layernorm", self.ln_f, x), self.wte)


def load(model: GPT, f) -> None:
    """Every parameter from the open step-0 checkpoint ``f`` (/model/<name with '/' for '.'>);
    hpctrain's Linear weights are (in, out), transposed into torch's (out, in)."""
    import common

    names = {n for n, _ in model.named_parameters()}
    stored = set()
    f["model"].visititems(lambda n, o: stored.add(n.replace("/", ".")) if hasattr(o, "shape") else None)
    if names != stored:
        raise ValueError(f"{f.filename}: its /model parameters differ from the configuration's GPT "
                         f"(only in the file: {sorted(stored - names)[:4]}, only in the model: "
                         f"{sorted(names - stored)[:4]}); make the checkpoint with the same model.* settings")
    for name, p in model.named_parameters():
        linear = p.dim() == 2 and name.endswith(".weight")  # not wte, wpe: those are (V, C), (T, C) in both
        common.copy_weight(p, f, "/model/" + name.replace(".", "/"), transpose=linear)


def cross_entropy(logits, y):
    """Mean cross-entropy over all B*T positions: logits (B, T, V), y (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
