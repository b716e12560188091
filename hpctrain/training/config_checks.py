"""The checks of a run configuration that read more than one section (:meth:`.config.Config.validate`
runs them after each section's own): pairs of settings that cannot run together, refused with one
:class:`~hpctrain.errors.ConfigError` that says what to change, before anything is built."""

from __future__ import annotations

from ..errors import ConfigError


def check_across_sections(cfg) -> None:
    """Raise ConfigError for the first combination of ``cfg``'s sections that cannot run."""
    if cfg.train.target_accuracy and not cfg.data.eval and cfg.model.kind == "mlp":
        raise ConfigError("train.target_accuracy is set but data.eval is empty; "
                          "name an evaluation file or set train.target_accuracy = 0")
    if (cfg.train.target_val_bpb or cfg.train.target_bpb_vs_bigram) and cfg.model.kind != "gpt":
        raise ConfigError("train.target_val_bpb and target_bpb_vs_bigram are language-model targets: they need "
                          "model.kind = \"gpt\" (the mlp's target is train.target_accuracy)")
    if cfg.train.precision == "fp16" and cfg.dist.compress != "none":
        raise ConfigError(f"train.precision='fp16' with dist.compress={cfg.dist.compress!r}"
                          + (f" (dist.reduce_dtype={cfg.dist.reduce_dtype!r})" if cfg.dist.reduce_dtype != "fp32"
                             else "")
                          + ": the compressors' error-feedback residuals would hold gradients times the loss "
                          "scale, which changes from step to step; use bf16 (no loss scale), or no compression")
    _check_min_lr(cfg)
    if cfg.dist.compress_momentum:
        _check_compress_momentum(cfg)
    if cfg.dist.zero == 3:
        _check_zero3(cfg)
    if cfg.dist.offload != "none":
        from ..optim.offload import check

        check(cfg)
    if cfg.dist.pipeline_parallel > 1 or cfg.dist.pipeline_stages:
        from .schedules import check_config

        check_config(cfg)
    if cfg.dist.tensor_parallel > 1:
        if cfg.model.kind != "gpt":
            raise ConfigError(f"dist.tensor_parallel={cfg.dist.tensor_parallel}: tensor parallelism splits the "
                              f"GPT's blocks; model.kind = {cfg.model.kind!r} trains data-parallel only "
                              f"(dist.tensor_parallel = 1)")
        if cfg.model.n_head % cfg.dist.tensor_parallel:
            raise ConfigError(f"dist.tensor_parallel={cfg.dist.tensor_parallel} does not divide model.n_head="
                              f"{cfg.model.n_head}: each tensor rank owns n_head / t whole heads")


def _check_min_lr(cfg) -> None:
    """The schedules decay from the peak lr (optim.lr, scaled by the linear scaling rule when asked) down
    to optim.min_lr: a floor above the peak would make the cosine climb."""
    from ..optim import peak_lr

    o = cfg.optim
    peak = peak_lr(o, cfg.train.global_batch)
    if o.min_lr > peak:
        scaled = (f" = optim.lr {o.lr:g} x train.global_batch {cfg.train.global_batch} / optim.base_batch "
                  f"{o.base_batch} (optim.scale_lr)" if o.scale_lr else "")
        raise ConfigError(f"optim.min_lr={o.min_lr:g} is above the peak learning rate {peak:g}{scaled}: the "
                          f"schedule decays from the peak to min_lr; lower optim.min_lr to {peak:g} or less")


def _check_zero3(cfg) -> None:
    """What ``dist.zero = 3`` does not run with, refused before anything is built."""
    if cfg.dist.bucket_split == "size":
        raise ConfigError("dist.zero=3 with dist.bucket_split='size': ZeRO-3 gathers the parameters a bucket at a "
                          "time, one layer unit each (a block's vectors, its attention's matrices, each MLP "
                          "matrix); use dist.bucket_split = layers or auto")
    if cfg.dist.pipeline_parallel > 1:
        raise ConfigError(f"dist.zero=3 with dist.pipeline_parallel={cfg.dist.pipeline_parallel}: a "
                          f"pipeline stage already holds only its layers; use dist.zero = 1 or 2 with pipeline "
                          f"parallelism")


def _check_compress_momentum(cfg) -> None:
    """Momentum correction hands AdamW's first moment to the compressor from the step compression
    starts, which is only the same first moment while the second moment is frozen from then on."""
    d, o = cfg.dist, cfg.optim
    if d.compress == "none":
        raise ConfigError("dist.compress_momentum corrects a compressor's momentum; dist.compress = 'none' "
                          "compresses nothing (set dist.compress, or compress_momentum = false)")
    if o.name != "adamw":
        raise ConfigError(f"dist.compress_momentum moves AdamW's first moment into the compressor; optim.name "
                          f"= {o.name!r} (use adamw, or compress_momentum = false)")
    if not d.compress_start_step or o.freeze_step != d.compress_start_step:
        raise ConfigError(f"dist.compress_momentum needs optim.freeze_step = dist.compress_start_step > 0 (the "
                          f"velocities are summed through AdamW's frozen second moment, from the step "
                          f"compression starts); they are {o.freeze_step} and {d.compress_start_step}")
    if o.clip_grad_norm:
        raise ConfigError(f"optim.clip_grad_norm={o.clip_grad_norm} with dist.compress_momentum: the buffers "
                          f"summed are velocities, not gradients, so clipping them would not clip the "
                          f"gradient (AdamW's first moment and each rank's unsent velocity stay unclipped); "
                          f"use one of them")
