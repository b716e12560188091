"""``python -m hpctrain sample --checkpoint F``: text from a GPT checkpoint (no launcher needed).

The checkpoint is read and verified like a resume (in a child process, every checksum
checked), the model is rebuilt on the CPU from the configuration stored in it, and
tokens are drawn one at a time from the last position's distribution (the context is
cropped to the model's ``model.context`` newest tokens; no KV cache: each token runs the
whole window, cheap at these sizes; the window is always ``context`` long, the tokens after the
newest one zero: causal attention never lets them reach it, and one shape keeps the layers' buffers
to one set). The same checkpoint, prompt and seed give the same
text; ``--temperature 0`` takes the most likely token every time (greedy). Under a
launcher only rank 0 samples and prints.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from .errors import UserError


def add_sample_parser(sub) -> None:
    s = sub.add_parser("sample", help="generate text from a GPT checkpoint (no MPI launcher needed)",
                       description="Generate text from a GPT checkpoint. Example: python -m hpctrain sample "
                                   "--checkpoint runs/gpt/ckpt/ckpt-00001500.h5 --prompt 'def ' --tokens 300")
    s.add_argument("--checkpoint", required=True, metavar="FILE", help="a checkpoint of a model.kind = \"gpt\" run")
    s.add_argument("--prompt", default="\n", help="text the sample continues (default: a newline)")
    s.add_argument("--tokens", type=int, default=300, help="tokens (bytes) to generate (default 300)")
    s.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0 = greedy, the most likely token every time (default 0.8)")
    s.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="draw only among the K most likely tokens; 0 = all (default 0)")
    s.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    s.set_defaults(func=cmd_sample)


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


def load_gpt(path: str):
    """The GPT saved in checkpoint ``path``, on the CPU in the checkpoint's dtype, and its config."""
    from .ckpt.read import load_checkpoint
    from .ckpt.state import parameter_path
    from .training.config_load import load_config_text
    from .device import CpuDevice
    from .models.gpt import GPT
    from .runtime import init_world

    if not os.path.isfile(path):
        raise UserError(f"--checkpoint {path!r}: no such file; list a run's checkpoints with "
                        f"'python -m hpctrain ckpt ls DIR'")
    from mpi4py import MPI

    loaded = load_checkpoint(path, init_world(MPI.COMM_SELF))  # verified; raises CorruptCheckpoint
    cfg = load_config_text(str(loaded.attrs.get("config", "")), f"{path} (its stored config)")
    if cfg.model.kind != "gpt" or "/model/wte" not in loaded.full:
        raise UserError(f"{path} is a checkpoint of a model.kind = \"{cfg.model.kind}\" run, not of a GPT; "
                        f"sample from a checkpoint of a model.kind = \"gpt\" run")
    m = cfg.model
    wte = loaded.full["/model/wte"]
    model = GPT(CpuDevice(wte.dtype), wte.shape[0], m.context, m.n_layer, m.n_head, m.d_model)
    for s in model.flat.slots:
        model.device.copy_from_host(model.flat.view(model.flat.data, s.name), loaded.full[parameter_path("model", s.name)])
    return model, cfg, loaded.step


def cmd_sample(args) -> int:
    from mpi4py import MPI  # noqa: F401 - every rank of a launch initialises MPI, or mpirun calls it a failure

    from .runtime import launched_rank

    if args.tokens < 0 or args.top_k < 0 or not args.temperature >= 0:
        raise UserError("sample: --tokens and --top-k must be >= 0 and --temperature >= 0 (0 = greedy)")
    if launched_rank() != 0:
        return 0  # one sample per launch, from rank 0
    model, cfg, step = load_gpt(args.checkpoint)
    prompt = np.frombuffer(args.prompt.encode("utf-8"), np.uint8)
    if len(prompt) == 0:
        raise UserError("sample: --prompt is empty; give at least one character (the default is a newline)")
    if prompt.max() >= model.vocab:
        raise UserError(f"sample: the prompt's bytes go up to {prompt.max()}, beyond the model's vocabulary of "
                        f"{model.vocab} tokens")
    out = generate(model, prompt, args.tokens, args.temperature, args.top_k, np.random.default_rng(args.seed))
    sys.stdout.write(bytes(out.astype(np.uint8)).decode("utf-8", "replace"))
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0
