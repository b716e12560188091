"""PyTorch DDP peer of the GPT: hpctrain's GPT, weights, windows, batch, optimizer and schedule, in PyTorch.

    python benchmarks/peers/init_checkpoint.py --config examples/gpt.toml --set ... --dir runs/init
    mpirun -n 2 python benchmarks/peers/torch_gpt.py --config examples/gpt.toml --set ... \\
        --resume runs/init/ckpt-00000000.h5 --set train.metrics=runs/peer.jsonl

It takes hpctrain's own ``--config`` / ``--set`` (parsed by ``hpctrain.training.config_load``),
so the same flags describe both runs:

* model: GPT-2 as hpctrain's ``model.kind = "gpt"`` (benchmarks/peers/gpt2_torch.py:
  pre-LN blocks, ``F.scaled_dot_product_attention(is_causal=True)``, GELU(tanh), head
  tied to wte, LayerNorm eps 1e-5, no dropout); every weight from the step-0
  checkpoint given by ``--resume`` (/model/wte, /model/wpe, /model/h/<i>/...,
  /model/ln_f/...; Linear weights (in, out) transposed into torch's (out, in));
* data: hpctrain's ``open_tokens``, ``TokenWindows`` over /train (``model.context``
  + 1 tokens per window) and ``TokenBatchReader`` on its ``DistributedSampler``,
  as hpctrain/models/gpt.py's ``open_data`` builds them, so the windows and their
  order are identical; loss = mean cross-entropy over the B x T positions of the
  rank (DDP averages over ranks, as hpctrain);
* optimizer: ``AdamW`` (or ``SGD``: both are modelled) with weight decay on the
  2-D parameters (the matrices, wte, wpe) and none on biases and LayerNorm
  parameters (hpctrain's ``GPT.no_decay``); hpctrain's ``LRSchedule`` sets the lr;
* ``train.op_times = true``: ``t_op_<family>`` per step as hpctrain's (gemm,
  attention, layernorm, embedding, loss, elementwise, optimizer) plus
  ``t_op_comm_wait`` (DDP's exposed all-reduce), by gpt2_torch.OpClock: forward
  ops timed around their calls, backward ops between identity autograd nodes; no
  profiler. Off, the model runs with no timing code in its path.
* DDP, threads, the metrics (hpctrain's, with tokens_per_s), ``--trace DIR`` and
  the exit codes (77: PyTorch not installed, setup.cfg extra ``peers``; 2: a
  setting the peer does not model) are the peers' common part,
  ``benchmarks/peers/common.py``. ``train.dtype`` float32 and float64 both work.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402 - the peers' shared part, beside this file


def build(cfg, world, resume: str, dtype) -> common.PeerModel:
    """The GPT with the checkpoint's weights, and this rank's window reader (called by :func:`common.main`)."""
    import torch

    import gpt2_torch
    from hpctrain.models.gpt import open_data

    m, tc = cfg.model, cfg.train
    data = open_data(cfg, world, None)  # hpctrain's own windows, sampler and reader: the same order
    try:
        use_cuda = tc.device in ("auto", "cuda") and torch.cuda.is_available()
        clock = gpt2_torch.OpClock(tc.op_times, torch.cuda.synchronize if use_cuda else None)
        vocab = data.info["vocab_size"]
        model = gpt2_torch.GPT(vocab, m.context, m.n_layer, m.n_head, m.d_model, dtype, clock)
        with common.open_step0(resume) as f:
            gpt2_torch.load(model, f)
    except BaseException:
        data.close()
        raise
    return common.PeerModel(
        model, data.reader, per_row=m.context,
        loss=lambda logits, y: clock.op("loss", gpt2_torch.cross_entropy, logits, y),
        no_decay=frozenset(n for n, p in model.named_parameters() if p.dim() == 1),
        describe=f"{m.n_layer} layers, d {m.d_model}, {m.n_head} heads, context {m.context}, vocabulary "
                 f"{vocab}; {data.describe}" + ("; op times on" if tc.op_times else ""),
        op_clock=clock if tc.op_times else None, close=data.close)


def main(argv=None) -> int:
    return common.main("torch_gpt", "gpt", __doc__, build, argv)


if __name__ == "__main__":
    sys.exit(main())
