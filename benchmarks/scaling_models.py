"""The models of benchmarks/scaling.py: presets and specs, their default steps and batch, data, settings
and step-0 checkpoint.

Two kinds (hpctrain's ``model.kind``), each with its PyTorch peer:

* mlp: input features and hidden widths, 10 classes, on synthetic data (``python -m hpctrain data
  synth``, one file per input width); peer benchmarks/peers/torch_ddp.py; a row is a sample.
* gpt: n_layer, d_model, n_head, context, with examples/gpt.toml's optimizer (AdamW, lr 3e-3,
  beta2 0.95, weight decay 0.1), on a byte-level token file (``--text``, default data/text.h5, made
  with ``python -m hpctrain data text`` when missing); peer benchmarks/peers/torch_gpt.py; a row is
  a window of ``context`` tokens, so tokens/s = samples/s x context.

Spec syntax of ``--models``: a preset name, ``name=DIM-H1-H2...`` (mlp) or
``name=gpt:LAYERS-D-HEADS-CONTEXT`` (gpt).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {
    "small": {"kind": "mlp", "dim": 32, "hidden": [128, 128]},      # 22 k parameters: per-step overheads dominate
    "mid": {"kind": "mlp", "dim": 256, "hidden": [1024, 1024]},     # 1.3 M parameters (5.3 MB of gradients)
    "large": {"kind": "mlp", "dim": 1024, "hidden": [4096, 4096]},  # 21 M parameters (84 MB): GEMM-bound
    # examples/gpt.toml's model: 0.84 M parameters; per step ~2/3 GEMM, the rest attention and elementwise
    "gpt": {"kind": "gpt", "n_layer": 4, "d_model": 128, "n_head": 4, "context": 128},
}
STEPS = {"small": (200, 20), "mid": (60, 10), "large": (6, 2), "gpt": (40, 5)}  # default (timed, warm-up)
BATCH = {"mlp": 256, "gpt": 16}  # default per-rank batch of weak scaling: rows; windows (16 x 128 tokens)
PEER = {"mlp": "torch_ddp", "gpt": "torch_gpt"}  # the PyTorch peer's script, and its rows' trainer


def gpt_optim_sets() -> list[str]:
    """examples/gpt.toml's [optim] as --set items: the benchmark trains the example's way."""
    from hpctrain.training.config_load import load_config

    optim = load_config(os.path.join(REPO, "examples", "gpt.toml")).optim
    return [f"optim.{k}={json.dumps(v)}" for k, v in dataclasses.asdict(optim).items()]


def parse_models(text: str) -> dict:
    """{name: model dict} of a --models list (ValueError naming the bad item)."""
    models = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, spec = item.partition("=")
        try:
            if spec.startswith("gpt:"):
                L, D, H, T = (int(v) for v in spec[4:].split("-"))
                models[name] = {"kind": "gpt", "n_layer": L, "d_model": D, "n_head": H, "context": T}
            elif spec:
                dims = [int(v) for v in spec.split("-")]
                models[name] = {"kind": "mlp", "dim": dims[0], "hidden": dims[1:]}
            elif name in PRESETS:
                models[name] = dict(PRESETS[name])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"unknown model {item!r}: use {', '.join(PRESETS)}, name=DIM-H1-H2 (an MLP) or "
                             f"name=gpt:LAYERS-D-HEADS-CONTEXT (a GPT)") from None
    return models


def describe(m: dict) -> str:
    """'32-128-128-10' or 'gpt 4 x d128, 4 heads, context 128'."""
    if m.get("kind", "mlp") == "gpt":
        return f"gpt {m['n_layer']} x d{m['d_model']}, {m['n_head']} heads, context {m['context']}"
    return "-".join(map(str, [m["dim"], *m["hidden"], 10]))


def _run(argv, env, what):
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{what} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def model_sets(runner, name: str, m: dict, data_dir: str) -> list[str]:
    """The --set of model ``m``'s runs (both trainers), its data file made first when missing."""
    a = runner.args
    if m["kind"] == "gpt":
        data = os.path.abspath(a.text)
        if not os.path.exists(data):
            _run(["-m", "hpctrain", "data", "text", "--out", data], runner.env, f"the token file {data}")
        # the final evaluation of a run reads 4 windows only: it is not part of the benchmark
        return ['model.kind="gpt"', *(f"model.{k}={m[k]}" for k in ("n_layer", "d_model", "n_head", "context")),
                f'data.train="{data}"', 'data.eval=""', f"train.eval_tokens={4 * m['context']}",
                "train.target_val_bpb=0", "train.target_bpb_vs_bigram=0", *gpt_optim_sets()]
    data = os.path.join(data_dir, f"synth-d{m['dim']}.h5")
    if not os.path.exists(data):
        _run(["-m", "hpctrain", "data", "synth", "--out", data, "--n", str(a.samples), "--dim", str(m["dim"]),
              "--seed", "1"], runner.env, f"synthetic data {data}")
    return [f'data.train="{data}"', 'data.eval=""', f"model.hidden={json.dumps(m['hidden'])}"]


def prepare(runner, name: str, m: dict, data_dir: str) -> tuple[list, str]:
    """The --set list of model ``name`` and its step-0 checkpoint (path); fills m's params (and vocab)."""
    a = runner.args
    sets = [*model_sets(runner, name, m, data_dir), f'train.device="{a.device}"', "train.target_accuracy=0",
            "train.log_every=1000000", "checkpoint.every_minutes=0",
            f'checkpoint.dir="{os.path.join(a.out, "ckpt", name)}"',
            f"checkpoint.keep_last={1 if a.ckpt_every else 0}", *a.set]
    out = _run([os.path.join(REPO, "benchmarks", "peers", "init_checkpoint.py"), "--dir",
                os.path.join(a.out, "init", name),
                *[x for s in sets + [f"train.global_batch={m['batch']}"] for x in ("--set", s)]],
               runner.env, f"step-0 checkpoint for {name}")
    init = out.strip().splitlines()[-1]
    import h5py  # plain serial reads (h5py does not start MPI)

    with h5py.File(init, "r") as f:
        sizes = []
        f["model"].visititems(lambda _, o: sizes.append(o.size) if isinstance(o, h5py.Dataset) else None)
        m["params"] = int(sum(sizes))
        if m["kind"] == "gpt":
            m["vocab"] = int(f["model/wte"].shape[0])
        else:
            m["classes"] = 10
    return sets, init
