"""Model families behind one small interface the trainer uses; ``model.kind`` picks one.

  mlp.py   a multi-layer perceptron classifier on the tabular format (/x, /y)
  gpt.py   a GPT-2 language model on the token format (/train, /val byte streams; its open_data
           in gpt_data.py, its layers' lanes and pipeline stages in gpt_layers.py, the blocks
           per stage balanced by stage_split.py)

A family module offers two functions, both called on every rank:

  open_data(cfg, world, device) -> TrainingData   this rank's view of the training and evaluation data
  build(cfg, device, data, tensor=None, stage=0, *, row_weight=None, tracer=None, ranges=None) -> model
                       the model, parameters zeroed (``init`` draws them); ``tensor``: the TensorGroup
                       that splits its layers (dist.tensor_parallel > 1); ``stage``: the pipeline stage
                       this rank holds (dist.pipeline_parallel > 1, GPT only: a stage model also offers
                       ``span``, ``lane(k)`` and ``stream_grad(shape)``, hpctrain.models.gpt_layers);
                       ``row_weight``: the loss's weight of one batch row where ranks' shares differ
                       (a number, or a Fraction the model divides exactly; None: the mean over each
                       call's rows); ``tracer`` (hpctrain.observe.trace) and
                       ``ranges`` (hpctrain.observe.nvtx): spans per layer, or None

and its model offers (the trainer, checkpoints and optimizer use nothing else):

  flat                 FlatParams: one flat parameter and one flat gradient buffer, named slots
                       (bucket layout and checkpoint paths come from the slot names)
  init(seed)           deterministic initial weights
  use_grad_buffer(buf, offsets=None)   keep the gradients in ``buf`` (e.g. the shm all-reduce's shared
                       window), at ``offsets`` per name if given (ZeRO-2's reused bucket slots)
  use_param_buffer(buf, offsets)   read the parameters from ``buf`` at ``offsets`` per name (ZeRO-3's
                       gathered slots)
  separate_layers()    optional: from then on each layer reads only its own parameters (ZeRO-3)
  forward(inputs, targets, totals=None, accumulate=False, *, loss_scale=1.0, fetch=None)
                       -> (loss_sum, correct) summed over this rank's predictions (with ``totals``:
                       kept on the device); ``loss_scale`` multiplies the loss's gradient (fp16);
                       ``fetch(names, forward)``, ZeRO-3's: called before a layer reads the parameters
                       ``names`` (it may wait for their all-gather)
  backward(accumulate, ready, claim, fetch)   d(mean loss)/d(params) into flat.grad (or added, with
                       accumulate); ``claim(names)`` before a layer writes the gradients of ``names`` (it
                       may wait until their memory is free), ``ready(name)`` for each parameter as soon
                       as its gradient is final
  backward_groups      the name tuples backward claims, in order
  forward_groups       the name tuples forward fetches (ZeRO-3), in order
  layer_units          the name tuples of the buckets under dist.bucket_split = "layers" (ZeRO-3's gather
                       units), each contiguous in ``flat``, in its order
  no_decay             names of parameters weight decay must not touch
  matrix_parts         {name: k} for a 2-D parameter (n, k m) that is k matrices (n, m) side by side
                       (a fused QKV weight): gradient compression's PowerSGD approximates each part
  targets_per_row      predictions per batch row (1 for a classifier, the context for a language model)
  input_dtype          dtype of ``inputs`` on the device (None: the compute dtype)
  flops_per_row        model FLOPs of one row's forward + backward (for MFU), or 0 when not counted
  activation_bytes(rows)   bytes of the activations a micro-batch of ``rows`` rows keeps for backward
  checkpoint_hint(shapes)  the fix to print when a checkpoint's parameter shapes do not fit
  tensor_layout        a TensorLayout (split parameters and their logical arrays) or None: optional
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

FAMILIES = ("mlp", "gpt")


@dataclass
class TrainingData:
    """One rank's data, as a model family opened it.

    ``reader.batch(step)`` gives this rank's (inputs, targets) host arrays of global step
    ``step`` (rows ``sampler.batch``); ``signature`` is what every rank must see alike
    (compared across ranks before training); ``eval_shard(rank, size, whole)`` yields (inputs,
    targets) chunks of this rank's share of the evaluation set (None: no evaluation), of all
    of it when ``whole`` (the final evaluation) and otherwise of the family's usual subset;
    ``units`` names what a row's predictions are counted in (samples, tokens);
    ``bits_per_byte`` is True when a prediction is one byte (the loss in bits is then bits per byte).
    """

    sampler: object
    reader: object
    signature: str
    eval_shard: Callable[..., Iterator[tuple]] | None = None
    describe: str = ""
    units: str = "samples"
    bits_per_byte: bool = False
    info: dict = field(default_factory=dict)   # family-specific facts for logs (e.g. the corpus baselines)
    close: Callable[[], None] = lambda: None


def family(kind: str):
    """The module of model family ``kind`` (imported on first use)."""
    if kind not in FAMILIES:
        raise ValueError(f"unknown model.kind {kind!r}")
    return importlib.import_module(f".{kind}", __package__)
