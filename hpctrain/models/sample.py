"""Text from a GPT: tokens drawn one at a time from the last position's distribution
(``python -m hpctrain sample``).

The context is cropped to the model's ``model.context`` newest tokens; no KV cache: each token
runs the whole window, cheap at these sizes; the window is always ``context`` long, the tokens
after the newest one zero: causal attention never lets them reach it, and one shape keeps the
layers' buffers to one set. The same model, prompt and seed give the same text;
``temperature = 0`` takes the most likely token every time (greedy).
"""

from __future__ import annotations

import numpy as np

from ..errors import UserError


def generate(model, prompt: np.ndarray, n_tokens: int, temperature: float, top_k: int,
             rng: np.random.Generator) -> np.ndarray:
    """``prompt`` (1-D token ids, at least one) followed by ``n_tokens`` drawn tokens."""
    tokens = [int(t) for t in prompt]
    window = np.zeros((1, model.context), np.int64)
    for _ in range(n_tokens):
        recent = tokens[-model.context:]
        window[0, :len(recent)] = recent
        logits = model.device.to_host(model.logits(window))[len(recent) - 1]  # the newest position's
        logits = np.asarray(logits, np.float64)
        if temperature == 0:
            tokens.append(int(np.argmax(logits)))
            continue
        logits = logits / temperature
        if 0 < top_k < len(logits):
            cut = np.partition(logits, -top_k)[-top_k]
            logits = np.where(logits >= cut, logits, -np.inf)
        p = np.exp(logits - logits.max())
        tokens.append(int(rng.choice(len(p), p=p / p.sum())))
    return np.asarray(tokens, np.int64)


def gpt_from_checkpoint(loaded, m):
    """The GPT whose parameters checkpoint ``loaded`` (a verified :func:`~hpctrain.ckpt.read.load_checkpoint`)
    holds, with the dimensions of its stored config's ``[model]`` section ``m``: on the CPU, in the
    checkpoint's dtype. A checkpoint of another model family is a :class:`UserError`."""
    from ..ckpt.state import parameter_path
    from ..device import CpuDevice
    from .gpt import GPT

    if m.kind != "gpt" or "/model/wte" not in loaded.full:
        raise UserError(f"{loaded.path} is a checkpoint of a model.kind = \"{m.kind}\" run, not of a GPT; "
                        f"sample from a checkpoint of a model.kind = \"gpt\" run")
    wte = loaded.full["/model/wte"]
    model = GPT(CpuDevice(wte.dtype), wte.shape[0], m.context, m.n_layer, m.n_head, m.d_model)
    for s in model.flat.slots:
        model.device.copy_from_host(model.flat.view(model.flat.data, s.name), loaded.full[parameter_path("model", s.name)])
    return model
