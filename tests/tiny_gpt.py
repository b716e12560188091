"""A tiny GPT config for the MPI tests of compression (and whatever else wants a GPT in seconds)."""

from hpctrain.training.config import Config

B = 12  # global batch in windows: divisible by 1, 2, 3 and 4 ranks


def gpt_config(text, compress="none", allreduce="mpi", scope="all", steps=2, d_model=16, context=8,
               n_layer=2, global_batch=B, dtype="float32", **sections):
    """A tiny GPT with several gradient buckets; ``sections`` = {"optim": {...}, "dist": {...}, ...}."""
    cfg = Config()
    cfg.model.kind = "gpt"
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = n_layer, 2, d_model, context
    cfg.data.train = text
    cfg.train.global_batch, cfg.train.steps, cfg.train.dtype, cfg.train.device = global_batch, steps, dtype, "cpu"
    cfg.train.log_every, cfg.train.metrics, cfg.train.eval_tokens = 10**6, "", 256
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay = "adamw", 3e-3, 0, 0.1
    cfg.dist.allreduce, cfg.dist.compress, cfg.dist.compress_scope = allreduce, compress, scope
    cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.008, 0.004  # several buckets, layers split between them
    cfg.checkpoint.every_minutes = 0
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg.validate()
