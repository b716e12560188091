"""The GPT family's data (:func:`open_data`, one of its two family functions, :mod:`hpctrain.models`):
``data.train``'s /train stream as windows of ``model.context + 1`` tokens, sampled and sharded per
step, and the /val stream (of ``data.eval`` when set) as this rank's evaluation chunks."""

from __future__ import annotations

import numpy as np

from ..data.sampler import DistributedSampler, shard_range
from ..data.tokens import TokenBatchReader, TokenWindows, eval_indices, open_tokens
from ..errors import DataError
from . import TrainingData

EVAL_WINDOWS_PER_CHUNK = 16  # windows per evaluation forward (bounded activation memory)


def open_data(cfg, world, device) -> TrainingData:
    """The /train windows this rank reads each step and its shard of the /val windows.

    Evaluations during training score ``train.eval_tokens`` tokens (windows spread over /val);
    the final one scores the whole split, the tokens the file's bigram baseline was scored on.
    """
    T = cfg.model.context
    train = open_tokens(cfg.data.train, "data.train")
    held = train
    try:
        if cfg.data.eval:
            held = open_tokens(cfg.data.eval, "data.eval")
        return _windows(cfg, world, T, train, held)
    except Exception:
        train.close()
        if held is not train:
            held.close()
        raise


def _windows(cfg, world, T, train, held) -> TrainingData:
    if held.vocab_size != train.vocab_size:
        raise DataError(f"data.eval {cfg.data.eval!r} has a vocabulary of {held.vocab_size} tokens but data.train "
                        f"{cfg.data.train!r} has {train.vocab_size}; evaluate on a file made the same way")
    windows = TokenWindows(train.train, T, f"data.train {cfg.data.train!r}", split="train")
    val = TokenWindows(held.val, T, f"{'data.eval' if cfg.data.eval else 'data.train'} {held.path!r}", split="val")
    sampler = DistributedSampler(windows.n, cfg.train.global_batch, world.rank, world.size, cfg.data.shuffle_seed,
                                 exact=cfg.train.exact_shares)
    chosen = eval_indices(val.n, -(-cfg.train.eval_tokens // T) if cfg.train.eval_tokens else 0)
    every = np.arange(val.n)
    # the baselines belong to the file whose /val is scored
    bytes_tokens = held.attrs.get("tokenizer") == "bytes"
    baselines = {k: float(held.attrs[k]) for k in ("bigram_bpb", "unigram_bpb") if k in held.attrs}
    _check_targets(cfg, held.path, bytes_tokens, baselines)

    def eval_shard(rank, size, whole=False):
        picked = every if whole else chosen
        lo, hi = shard_range(len(picked), rank, size)
        for start in range(lo, hi, EVAL_WINDOWS_PER_CHUNK):
            yield val.read(picked[start:min(hi, start + EVAL_WINDOWS_PER_CHUNK)])

    def close():
        train.close()
        if held is not train:
            held.close()

    return TrainingData(sampler, TokenBatchReader(windows, sampler),
                        signature=f"{windows.n} train windows, {val.n} val windows, vocabulary {train.vocab_size}, "
                                  f"context {T}",
                        eval_shard=eval_shard, units="tokens", bits_per_byte=bytes_tokens,
                        describe=f"{windows.n:,} windows of {T} + 1 tokens from {len(train.train):,} tokens, "
                                 f"{len(chosen) * T:,} validation tokens per evaluation during training, "
                                 f"{val.n * T:,} at the end, vocabulary {train.vocab_size}",
                        info={"vocab_size": train.vocab_size, **baselines}, close=close)


def _check_targets(cfg, path, bytes_tokens, baselines):
    """The bits-per-byte targets need byte tokens (and the relative one the file's bigram baseline)."""
    tc = cfg.train
    if (tc.target_val_bpb or tc.target_bpb_vs_bigram) and not bytes_tokens:
        raise DataError(f"{path!r} does not hold byte tokens (its tokenizer attribute is not 'bytes'), so "
                        f"train.target_val_bpb / target_bpb_vs_bigram (bits per byte) cannot be measured; "
                        f"set them to 0 or evaluate on a file made by 'python -m hpctrain data text'")
    if tc.target_bpb_vs_bigram and "bigram_bpb" not in baselines:
        raise DataError(f"{path!r} has no bigram_bpb attribute for train.target_bpb_vs_bigram to scale; remake it "
                        f"with 'python -m hpctrain data text' or set an absolute train.target_val_bpb")
