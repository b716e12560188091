"""The run's optimizer from its configuration: ``optim.name`` over the flat buffer (or this rank's
ZeRO chunks), on the device or offloaded to the host (``dist.offload``)."""

from __future__ import annotations

from .elementwise import SGD, AdamW
from .layerwise import LAMB, LARS


def build_optimizer(device, flat, cfg, no_decay=frozenset(), shards=None, grads=None, velocity_from=0, params=None):
    """The run's optimizer: :func:`make_optimizer` for ``cfg.optim`` on ``device``, or under
    ``dist.offload = "optimizer"`` the same over pinned host arrays, wrapped to feed and be fed from
    the device (:class:`~hpctrain.optim.offload.OffloadedOptimizer`)."""
    if cfg.dist.offload == "none":
        return make_optimizer(device, flat, cfg.optim, no_decay, shards, grads, velocity_from, params)
    from .offload import OffloadedOptimizer

    if device.name != "cuda":
        from ..errors import ConfigError

        raise ConfigError(f"dist.offload={cfg.dist.offload!r} on the {device.name} device (train.device="
                          f"{cfg.train.device!r} found no GPU): the optimizer already runs in host memory, there "
                          f"is nothing to offload from; use dist.offload = none")

    def make(host, host_flat, host_shards, host_grads, host_params):
        return make_optimizer(host, host_flat, cfg.optim, no_decay, host_shards, host_grads, velocity_from,
                              host_params)

    return OffloadedOptimizer(device, flat, make, shards, grads, params)


def make_optimizer(device, flat, cfg_optim, no_decay=frozenset(), shards=None, grads=None, velocity_from=0,
                   params=None):
    """The optimizer ``optim.name`` over ``flat``; parameters named in ``no_decay`` get no weight decay;
    with ``shards`` (ZeRO) it keeps state for this rank's chunks only, with ``grads`` (ZeRO-2) it reads
    their gradient from there, with ``params`` (ZeRO-3) it updates their parameters there;
    ``velocity_from`` (AdamW only): see :class:`AdamW`."""
    if cfg_optim.name != "adamw" and velocity_from:
        raise ValueError(f"velocity_from: {cfg_optim.name} has no velocity mode (dist.compress_momentum needs adamw)")
    if cfg_optim.name == "sgd":
        return SGD(device, flat, cfg_optim, no_decay, shards, grads, params)
    if cfg_optim.name in ("lamb", "lars"):
        return (LAMB if cfg_optim.name == "lamb" else LARS)(device, flat, cfg_optim, no_decay, shards, grads, params)
    return AdamW(device, flat, cfg_optim, no_decay, shards, grads, velocity_from, params)
