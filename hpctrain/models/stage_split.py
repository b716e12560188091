"""How a pipeline splits a model's blocks into stages (``dist.pipeline_balance``, when
``dist.pipeline_stages`` is []): :func:`balance` cuts n blocks of one cost into p contiguous
stages, the first and last stage costing more by what they hold beside their blocks, so that the
largest stage costs the least. A model family says what a block and each end cost (the GPT:
:func:`~.gpt.stage_blocks`, by parameters or by FLOPs).
"""

from __future__ import annotations


def balance(n_layer: int, p: int, block: int, first: int = 0, last: int = 0) -> list[int]:
    """Blocks per stage, p contiguous runs of the ``n_layer`` blocks (each costing ``block``: parameters,
    or FLOPs) with the largest stage's cost as small as it can be, the first stage costing ``first``
    more (the embedding) and the last ``last`` more (the tied head, ln_f, the loss). Among equally good
    splits, the one with the earliest stages largest (the later stages, nearer the loss, hold fewer
    micro-batches' activations under 1F1B but run the head)."""
    if not 1 <= p <= n_layer:
        raise ValueError(f"{p} stage(s) for {n_layer} block(s)")
    extra = lambda s: (first if s == 0 else 0) + (last if s == p - 1 else 0)  # noqa: E731
    # best[s][k]: (the smallest largest stage, its split) of stages s .. p-1 over the last k blocks
    best: dict = {}
    for s in range(p - 1, -1, -1):
        for k in range(p - s, n_layer - s + 1):
            if s == p - 1:
                best[s, k] = (k * block + extra(s), [k])
                continue
            options = []
            for here in range(k - (p - s - 1), 0, -1):   # the most blocks here first
                rest, split = best[s + 1, k - here]
                options.append((max(here * block + extra(s), rest), [here] + split))
            best[s, k] = min(options, key=lambda o: o[0])
    return best[0, n_layer][1]
