"""PyTorch DDP peer: hpctrain's MLP, weights, data order, batch, optimizer and schedule, in PyTorch.

    python benchmarks/peers/init_checkpoint.py --set ... --dir runs/init          # step-0 weights
    mpirun -n 2 python benchmarks/peers/torch_ddp.py --set ... --resume runs/init/ckpt-00000000.h5 \\
        --set train.metrics=runs/peer.jsonl

It takes hpctrain's own ``--config`` / ``--set`` (parsed by ``hpctrain.training.config_load``),
so the same flags describe both runs:

* model: ``Linear(+ReLU | GELU(tanh))`` per ``model.hidden``, then a Linear to
  the classes, mean cross-entropy; weights and biases from the step-0
  checkpoint given by ``--resume`` (hpctrain's ``/model/fc<i>/weight`` is (in,
  out), transposed into torch's (out, in));
* data: hpctrain's ``DistributedSampler`` and ``BatchReader`` (permutation per
  (shuffle_seed, epoch), rank r takes rows [r b, (r+1) b) of each global batch,
  the same read-ahead from HDF5), so data cost and order are identical;
* optimizer: ``torch.optim.SGD`` (momentum, nesterov, weight decay) or
  ``AdamW`` (weight decay on every parameter), with hpctrain's ``LRSchedule``
  setting the lr of every step;
* DDP, threads, the per-step metrics (step, global loss and accuracy, lr,
  step_time, samples_per_s, t_data, t_forward, t_backward with DDP's all-reduce
  inside, t_optimizer, t_other), ``--trace DIR`` (a torch.profiler Chrome trace
  per rank) and the exit codes (77: PyTorch not installed, setup.cfg extra
  ``peers``; 2: a setting the peer does not model) are the peers' common part,
  ``benchmarks/peers/common.py``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402 - the peers' shared part, beside this file


def load_weights(model_layers, path: str) -> None:
    """Copy /model/fc<i>/{weight,bias} of an hpctrain checkpoint into torch Linear layers."""
    with common.open_step0(path) as f:
        for i, layer in enumerate(model_layers):
            common.copy_weight(layer.weight, f, f"/model/fc{i}/weight", transpose=True)
            common.copy_weight(layer.bias, f, f"/model/fc{i}/bias")


def build(cfg, world, resume: str, dtype) -> common.PeerModel:
    """The MLP with the checkpoint's weights, and this rank's reader (called by :func:`common.main`)."""
    import numpy as np
    import torch

    from hpctrain.data import BatchReader, DistributedSampler, open_dataset

    ds = open_dataset(cfg.data.train, "data.train")
    sampler = DistributedSampler(ds.n, cfg.train.global_batch, world.rank, world.size, cfg.data.shuffle_seed)
    widths = [ds.dim, *cfg.model.hidden, ds.n_classes]
    linears = [torch.nn.Linear(widths[i], widths[i + 1], dtype=dtype) for i in range(len(widths) - 1)]
    load_weights(linears, resume)
    act = torch.nn.ReLU if cfg.model.activation == "relu" else (lambda: torch.nn.GELU(approximate="tanh"))
    layers = []
    for i, lin in enumerate(linears):
        layers += [lin] + ([act()] if i < len(linears) - 1 else [])
    reader = BatchReader(ds, sampler, np.float32 if dtype == torch.float32 else np.float64)
    return common.PeerModel(torch.nn.Sequential(*layers), reader)


def main(argv=None) -> int:
    return common.main("torch_ddp", "mlp", __doc__, build, argv)


if __name__ == "__main__":
    sys.exit(main())
