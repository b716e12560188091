"""The run configuration: one dataclass per section, every field with its default, its one-line
reason (``help``, shown by ``python -m hpctrain train --help-config``) and the checks of its values
(``validate``), and the whole :class:`Config` with the checks across sections.

Reading a configuration (TOML file, ``--set`` overrides, the text a checkpoint stores) is
:mod:`.config_load`; :meth:`Config.to_toml` writes one back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..models import FAMILIES
from .config_checks import check_across_sections


def _f(default, why, **kw):
    """A dataclass field whose metadata carries the reason for its default."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": why, **kw})
    return field(default=default, metadata={"help": why, **kw})


@dataclass
class ModelConfig:
    kind: str = _f("mlp", "mlp (classifier on the tabular x/y format) | gpt (GPT-2 language model on the token "
                   "format)", choices=FAMILIES)
    hidden: list[int] = _f([256, 256], "mlp: two hidden layers learn the teacher task to >90% quickly")
    activation: str = _f("relu", "mlp: relu | gelu; relu is cheapest", choices=("relu", "gelu"))
    n_layer: int = _f(4, "gpt: transformer blocks; 4 x d 128 is ~1 M parameters, minutes on a CPU")
    n_head: int = _f(4, "gpt: attention heads; must divide d_model (head size d_model / n_head)")
    d_model: int = _f(128, "gpt: channels of the residual stream (the MLP is 4 x wider)")
    context: int = _f(128, "gpt: tokens per training window (and the largest position); the vocabulary "
                      "comes from the data file")
    attention: str = _f("auto", "gpt on cuda: flash (tiled kernels, no T x T array) | gemm (cuBLAS batched GEMMs "
                        "around a softmax kernel; T x T scores per chunk of heads, at most 256 MiB) | auto (gemm "
                        "where cuBLAS runs and T >= 256 or a head is wider than 128, else flash); the CPU "
                        "always computes attention with BLAS GEMMs", choices=("auto", "flash", "gemm"))
    recompute: str = _f("none", "gpt: none | blocks (a block keeps only its input in forward and recomputes "
                        "its activations in backward: less memory, one more forward per block)",
                        choices=("none", "blocks"))

    def validate(self):
        if any(h < 1 for h in self.hidden):
            raise ConfigError(f"model.hidden={self.hidden}: every width must be >= 1")
        for key in ("n_layer", "n_head", "d_model", "context"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}={getattr(self, key)}: must be >= 1")
        if self.kind == "gpt" and self.d_model % self.n_head:
            divisors = [h for h in range(1, min(self.d_model, 64) + 1) if self.d_model % h == 0]
            raise ConfigError(f"model.n_head={self.n_head} does not divide model.d_model={self.d_model}; "
                              f"every head gets d_model / n_head channels: choose n_head from "
                              f"{', '.join(map(str, divisors))} or change d_model")


@dataclass
class DataConfig:
    train: str = _f("data/synth-train.h5", "mlp: HDF5 file with /x float32 [N, D] and /y int64 [N]; gpt: a "
                    "token file (python -m hpctrain data text) whose /train stream is trained on")
    eval: str = _f("", "mlp: held-out HDF5 file in the same format, empty = no evaluation; gpt: a token file "
                   "whose /val stream is evaluated, empty = data.train's own /val")
    shuffle_seed: int = _f(1234, "one permutation per (seed, epoch), identical on every rank")

    def validate(self):
        if self.shuffle_seed < 0:
            raise ConfigError(f"data.shuffle_seed={self.shuffle_seed}: must be >= 0")


@dataclass
class TrainConfig:
    global_batch: int = _f(256, "rows per step over all ranks (mlp: samples; gpt: windows of context tokens); "
                           "per-rank batch = global / world size (shares differ by at most one row where "
                           "the world size does not divide it)")
    exact_shares: bool = _f(False, "true = refuse a world size that does not divide train.global_batch; false = "
                            "ranks take shares that differ by at most one row and the gradient average is "
                            "weighted by share, so any world size trains as one rank with the whole batch")
    steps: int = _f(1500, "optimizer steps; epochs follow from the dataset size")
    dtype: str = _f("float32", "float32 for speed; float64 for exactness checks", choices=("float32", "float64"))
    precision: str = _f("fp32", "fp32 (everything in train.dtype) | bf16 | fp16: activations and the parameters' "
                        "compute copy in 16 bits (the residual stream stays float32: 0.55x the example GPT's "
                        "activations), float32 inside every op, float32 master parameters, gradients and optimizer "
                        "state (needs train.dtype = float32); fp16 adds dynamic loss scaling (docs/precision.md)", choices=("fp32", "bf16", "fp16"))
    loss_scale: float = _f(65536.0, "fp16: the initial loss scale (PyTorch GradScaler's 2^16); halved at each "
                           "overflowing step, which is skipped")
    loss_scale_window: int = _f(2000, "fp16: applied steps in a row after which the loss scale doubles "
                                "(GradScaler's growth_interval)")
    device: str = _f("auto", "auto | cpu | cuda; auto takes a GPU (local_rank % visible GPUs) when one is visible",
                     choices=("auto", "cpu", "cuda"))
    gemm: str = _f("auto", "cuda GEMMs: numba (our tiled kernel, the reference) | cublas (CuPy's cuBLAS on the "
                   "same memory and stream) | auto (cublas when CuPy imports, else numba); cpu: NumPy's BLAS",
                   choices=("auto", "numba", "cublas"))
    sync_phases: bool = _f(False, "cuda: wait for the GPU at the end of every phase (data, forward, backward, ...) "
                           "so phase times are the GPU's; off, a step queues its kernels without waiting and "
                           "phase times are the host's (tracing always waits)")
    seed: int = _f(0, "initial weights; rank 0's are broadcast so all ranks start equal")
    log_every: int = _f(100, "progress line period in steps (non-TTY logs get one line each)")
    eval_every: int = _f(0, "evaluate every k steps; 0 = only at the end")
    target_accuracy: float = _f(0.0, "final eval accuracy the run must reach (0 = no target); missing it exits 3")
    target_val_bpb: float = _f(0.0, "gpt: final validation bits per byte the run must reach or beat (0 = no "
                               "target); missing it exits 3")
    target_bpb_vs_bigram: float = _f(0.0, "gpt: the same target as a fraction of the data file's bigram baseline "
                                     "(e.g. 0.75; follows the corpus, unlike an absolute bpb); 0 = none")
    eval_tokens: int = _f(65536, "gpt: validation tokens per evaluation during training, windows spread evenly "
                          "over the split (the same ones every time; 0 = the whole split); the final "
                          "evaluation always scores the whole split")
    metrics: str = _f("", "per-step metrics as JSON lines, written by rank 0; empty = off")
    grad_accum_steps: int = _f(1, "micro-batches per step: gradients accumulate locally and are "
                               "communicated once, on the last (micro-batches differ by at most one row; "
                               "with train.exact_shares the per-rank batch must divide evenly)")
    op_times: bool = _f(False, "time every model op by family (gemm, attention, layernorm, embedding, loss, "
                        "elementwise, optimizer) into the metrics as t_op_*; on a GPU it synchronises per op")
    trace: str = _f("", "write a Chrome trace per rank into this directory (also --trace; merge with "
                    "python -m hpctrain trace merge DIR); empty = off, no cost")
    cuda_graphs: str = _f("auto", "cuda: replay each micro-batch's forward and backward as a CUDA graph (one "
                           "launch instead of hundreds; the all-reduce then follows backward instead of "
                           "overlapping it) | auto (where graphs can run and one data-parallel rank) | on "
                           "(also across data-parallel ranks) | off", choices=("auto", "on", "off"))
    nvtx: bool = _f(False, "NVTX ranges per step, phase, layer and bucket for Nsight Systems (nsys profile -t "
                    "cuda,nvtx,mpi ...), through CuPy; nothing waits for the GPU; off = no cost")

    def validate(self):
        if self.seed < 0:
            raise ConfigError(f"train.seed={self.seed}: must be >= 0")
        if self.global_batch < 1:
            raise ConfigError(f"train.global_batch={self.global_batch}: must be >= 1")
        if self.steps < 0:
            raise ConfigError(f"train.steps={self.steps}: must be >= 0")
        if self.log_every < 1:
            raise ConfigError(f"train.log_every={self.log_every}: must be >= 1")
        if self.precision != "fp32" and self.dtype != "float32":
            raise ConfigError(f"train.precision={self.precision!r} keeps float32 master parameters, but train.dtype "
                              f"= {self.dtype!r}; use train.dtype = 'float32' (float64 is for exactness checks, "
                              f"in fp32)")
        if not 1.0 <= self.loss_scale < math.inf or self.loss_scale_window < 1:
            raise ConfigError(f"train.loss_scale={self.loss_scale} and loss_scale_window={self.loss_scale_window}: "
                              f"a scale >= 1 and a window >= 1 step")
        if self.grad_accum_steps < 1:
            raise ConfigError(f"train.grad_accum_steps={self.grad_accum_steps}: must be >= 1")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every={self.eval_every}: must be >= 0")
        if not 0.0 <= self.target_val_bpb < math.inf:  # also false for nan
            raise ConfigError(f"train.target_val_bpb={self.target_val_bpb}: bits per byte >= 0 (0 = no target)")
        if not 0.0 <= self.target_bpb_vs_bigram < math.inf:
            raise ConfigError(f"train.target_bpb_vs_bigram={self.target_bpb_vs_bigram}: a fraction > 0 of the "
                              f"bigram baseline (e.g. 0.75), or 0 = no target")
        if self.eval_tokens < 0:
            raise ConfigError(f"train.eval_tokens={self.eval_tokens}: must be >= 0 (0 = the whole split)")
        if not 0.0 <= self.target_accuracy <= 1.0:  # also false for nan
            raise ConfigError(f"train.target_accuracy={self.target_accuracy}: a fraction in [0, 1], e.g. 0.9")


@dataclass
class OptimConfig:
    name: str = _f("sgd", "sgd (momentum) | adamw | lamb (AdamW's direction, each parameter's step scaled by "
                   "||w|| / ||step||) | lars (momentum SGD, each parameter's lr scaled by trust_coefficient "
                   "||w|| / (||g|| + weight_decay ||w||)); lamb and lars leave the GPT's biases and LayerNorm "
                   "parameters unscaled (docs/optimizers.md)", choices=("sgd", "adamw", "lamb", "lars"))
    lr: float = _f(0.1, "peak learning rate (after warmup, before decay)")
    momentum: float = _f(0.9, "SGD and LARS momentum; 0.9 is the usual choice")
    nesterov: bool = _f(False, "Nesterov momentum for SGD")
    trust_coefficient: float = _f(0.001, "LARS: eta, the trust ratio's coefficient (You et al. 2017)")
    weight_decay: float = _f(0.0, "L2 (SGD) or decoupled (AdamW) decay; mlp: every parameter; gpt: matrices "
                             "and embeddings only, never biases or LayerNorm parameters")
    beta1: float = _f(0.9, "AdamW and LAMB first-moment decay")
    beta2: float = _f(0.999, "AdamW and LAMB second-moment decay")
    eps: float = _f(1e-8, "AdamW and LAMB denominator guard")
    freeze_step: int = _f(0, "adamw: the second moment takes the gradients of global steps 0 .. F-1 and is "
                          "frozen from global step F on (1-bit Adam's frozen variance), so the update is linear "
                          "in the gradient and error-feedback compression adds up as the uncompressed gradient "
                          "would; set it to dist.compress_start_step (docs/dist.md); 0 = never")
    schedule: str = _f("cosine", "after warmup: cosine | step | constant",
                       choices=("cosine", "step", "constant"))
    warmup_steps: int = _f(100, "linear warmup from 0; large batches need it")
    min_lr: float = _f(0.0, "cosine floor")
    step_size: int = _f(1000, "step schedule: decay every k steps")
    gamma: float = _f(0.1, "step schedule: multiply lr by gamma")
    clip_grad_norm: float = _f(0.0, "clip the global L2 norm of the averaged gradient (over all ranks, every "
                               "parameter counted once) to this before the update; 0 = off (GPT practice: 1.0)")
    scale_lr: bool = _f(False, "linear scaling rule: lr x global_batch / base_batch")
    base_batch: int = _f(256, "batch size at which lr was tuned (for scale_lr)")

    def validate(self):
        for key in ("lr", "momentum", "weight_decay", "beta1", "beta2", "eps", "min_lr", "gamma", "clip_grad_norm",
                    "trust_coefficient"):
            if not math.isfinite(getattr(self, key)):
                raise ConfigError(f"optim.{key}={getattr(self, key)}: must be a finite number")
        if self.gamma <= 0:
            raise ConfigError(f"optim.gamma={self.gamma}: must be > 0")
        if self.lr <= 0:
            raise ConfigError(f"optim.lr={self.lr}: must be > 0")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optim.momentum={self.momentum}: must be in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay={self.weight_decay}: must be >= 0")
        if self.clip_grad_norm < 0:
            raise ConfigError(f"optim.clip_grad_norm={self.clip_grad_norm}: must be >= 0 (0 = off)")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"optim.beta1/beta2=({self.beta1}, {self.beta2}): each must be in [0, 1)")
        if self.freeze_step < 0:
            raise ConfigError(f"optim.freeze_step={self.freeze_step}: a step >= 0 (0 = never freeze)")
        if self.trust_coefficient <= 0:
            raise ConfigError(f"optim.trust_coefficient={self.trust_coefficient}: must be > 0 (LARS uses 0.001)")
        if self.name == "lars" and self.nesterov:
            raise ConfigError("optim.nesterov with optim.name = 'lars': LARS is heavy-ball momentum as published "
                              "(You et al. 2017); set optim.nesterov = false")
        if self.freeze_step and self.name != "adamw":
            raise ConfigError(f"optim.freeze_step={self.freeze_step} freezes AdamW's second moment; optim.name = "
                              f"{self.name!r} has none (set it to 0, or use adamw)")
        if self.eps <= 0 or self.warmup_steps < 0 or self.step_size < 1 or self.base_batch < 1:
            raise ConfigError("optim.eps > 0, optim.warmup_steps >= 0, optim.step_size >= 1 "
                              "and optim.base_batch >= 1 are required")
        if self.min_lr < 0:   # (its upper bound is the peak lr, which needs train.global_batch: config_checks)
            raise ConfigError(f"optim.min_lr={self.min_lr}: must be >= 0")


@dataclass
class DistConfig:
    allreduce: str = _f("mpi", "gradient averaging strategy: mpi (MPI_Allreduce) | naive (reduce+bcast oracle) "
                        "| ring (reduce-scatter + all-gather) | rhd (recursive halving-doubling) "
                        "| hierarchical (in node, across nodes, in node) | shm (one machine: shared-memory "
                        "window, zero copy) | auto (fastest per size, measured)",
                        choices=("mpi", "naive", "ring", "rhd", "hierarchical", "shm", "auto"))
    hierarchical_inner: str = _f("mpi", "flat strategy hierarchical uses across nodes",
                                 choices=("mpi", "naive", "ring", "rhd"))
    auto_cache: str = _f("runs/allreduce-auto.json", "where auto keeps its measured alpha-beta fits; empty = "
                         "measure every run")
    bucket_mb: float = _f(25.0, "gradient bucket size (MB) reduced while backward runs (as PyTorch DDP); "
                          "0 = one bucket after backward")
    first_bucket_mb: float = _f(1.0, "the first bucket is small so communication starts early")
    bucket_split: str = _f("auto", "how the parameters are cut into buckets: size (bucket_mb, first_bucket_mb) | "
                           "layers (a bucket per layer unit: each block's vectors, its attention's two matrices, "
                           "each MLP matrix; the tables, ln_f) | auto = layers under dist.zero = 3 (the units it "
                           "gathers), else size", choices=("auto", "size", "layers"))
    overlap: bool = _f(True, "reduce buckets on a communication thread during backward; false = after it")
    ranks_per_node: int = _f(0, "simulate nodes of k ranks on one machine; 0 = real nodes (shared memory)")
    compress: str = _f("none", "gradient compression: none | fp16 | bf16 | topk(ratio) | randk(ratio) | sign | "
                       "powersgd(rank[, start_step]); with error feedback except none (docs/dist.md)")
    reduce_dtype: str = _f("fp32", "gradients on the wire: fp32 | bf16 | fp16 (2 bytes a value, half the bytes; "
                           "a ring of 16-bit messages with float32 sums, the rounding error kept per rank and "
                           "sent later): the same as dist.compress = bf16 / fp16, which it sets; any other "
                           "dist.compress already chooses the wire format and is refused with it",
                           choices=("fp32", "bf16", "fp16"))
    compress_start_step: int = _f(0, "global steps 0 .. S-1 are all-reduced exactly by dist.allreduce, "
                                  "compression starts at step S (its warm-up: the early, fast-changing gradients go "
                                  "exact; with adamw set optim.freeze_step to the same step, docs/dist.md)")
    compress_momentum: bool = _f(False, "momentum correction (Deep Gradient Compression): each rank keeps AdamW's "
                                 "first moment of its own gradients and the compressor sends that, masking what it "
                                 "sent (top-k, random-k entries; PowerSGD's subspace); needs optim.name = adamw and "
                                 "optim.freeze_step = dist.compress_start_step > 0 (docs/dist.md)")
    compress_scope: str = _f("all", "all = compress every bucket everywhere | inter = only hierarchical's "
                             "cross-node phase (intra-node stays exact)", choices=("all", "inter"))
    cuda_aware_mpi: str = _f("auto", "hand GPU buffers to MPI directly: auto (ask the MPI library) | on | off "
                             "(copy through pinned host buffers)", choices=("auto", "on", "off"))
    zero: int = _f(0, "state sharding: 0 = every rank keeps all of it | 1 = each rank keeps the optimizer state "
                   "of its 1/N share of every bucket (ZeRO-1: gradients reduce-scattered, parameters "
                   "all-gathered) | 2 = and of the gradients only that share, plus a few bucket slots backward "
                   "reuses (ZeRO-2: a reduce-scatter per micro-batch); with every dist.allreduce (mpi, "
                   "ring, rhd, shm, auto and hierarchical on nodes of one size have reduce-scatters of "
                   "their own; naive reduce-scatters by its whole all-reduce); with tensor parallelism the shares "
                   "are cut from each tensor rank's own pieces, over its data group | 3 = and of the "
                   "parameters only that share: each layer's buckets all-gathered into a few reused slots "
                   "before it runs, forward and backward, the next one ahead on a thread (ZeRO-3, as FSDP; "
                   "the GPT's tied table stays gathered from its first use to the update; under bf16 / fp16 the "
                   "slots hold the rounded 16-bit copy, half the bytes gathered; no pipeline)",
                   choices=(0, 1, 2, 3))
    offload: str = _f("none", "optimizer = the optimizer's state and update in host memory, on the CPU "
                      "(ZeRO-Offload: each bucket's gradient copied to the host as it is reduced, updated there "
                      "with the CPU kernels, the parameters copied back; train.device = cuda only); with "
                      "every dist.zero | none", choices=("none", "optimizer"))
    tensor_parallel: int = _f(1, "tensor (model) parallel size t (GPT only): groups of t consecutive ranks split "
                              "each block Megatron's way (QKV and the MLP's first Linear by columns, n_head / t heads "
                              "and 4 d_model / t hidden units per rank; both output projections by rows; embeddings, "
                              "tied head and LayerNorms replicated); the world size / t data-parallel groups average "
                              "gradients with dist.allreduce (and shard them with dist.zero). t divides the world size "
                              "and model.n_head")
    pipeline_parallel: int = _f(1, "pipeline stages p (GPT only): the blocks in p contiguous stages on p ranks "
                                "(stage = world rank // (world size / p): a stage's data and tensor groups are "
                                "consecutive ranks), activations and their gradients passed between neighbours by "
                                "MPI point-to-point; the embedding on the first stage, ln_f and the tied head on "
                                "the last (the tied table's two gradients summed between them); micro-batches are "
                                "train.grad_accum_steps (docs/pipeline.md)")
    pipeline_schedule: str = _f("1f1b", "the order of a stage's micro-batches: 1f1b (one forward, one backward: "
                                "at most p micro-batches' activations held) | gpipe (every forward, then every "
                                "backward: all m held); both idle (p - 1) / (m + p - 1) of a step",
                                choices=("1f1b", "gpipe"))
    pipeline_stages: list[int] = _f([], "blocks per stage, first stage first (e.g. [3, 5]); [] = balanced "
                                    "by dist.pipeline_balance")
    pipeline_balance: str = _f("parameters", "how [] pipeline_stages splits the blocks: parameters (the largest "
                               "stage's parameter count smallest: the embedding counted on the first stage, the "
                               "tied head and ln_f on the last; memory) | compute (the slowest stage's model "
                               "FLOPs smallest: the head and loss counted on the last stage, the embedding's "
                               "lookup as free; the step's pace)", choices=("parameters", "compute"))
    comm_timeout: float = _f(300.0, "seconds a collective may wait for the other ranks before the watchdog "
                             "reports which ranks are missing and aborts the job (checkpoint saves and "
                             "evaluation get 10x while every rank still answers); 0 = off")

    def validate(self):
        if self.reduce_dtype != "fp32":   # first: every check of dist.compress below sees the wire format
            if self.compress not in ("none", self.reduce_dtype):
                raise ConfigError(f"dist.reduce_dtype={self.reduce_dtype!r} with dist.compress={self.compress!r}: "
                                  f"the compressor already chooses what goes on the wire; set one of them")
            self.compress = self.reduce_dtype   # the 16-bit wire format is the fp16 / bf16 compressor's
        if not self.bucket_mb >= 0:  # also catches nan
            raise ConfigError(f"dist.bucket_mb={self.bucket_mb}: a size in MB >= 0 (e.g. 25; 0 = one bucket "
                              f"reduced after backward)")
        if not self.first_bucket_mb > 0:
            raise ConfigError(f"dist.first_bucket_mb={self.first_bucket_mb}: a size in MB > 0 (e.g. 1: a small "
                              f"first bucket starts communication early)")
        if self.ranks_per_node < 0:
            raise ConfigError(f"dist.ranks_per_node={self.ranks_per_node}: must be >= 0")
        if not 0 <= self.comm_timeout < math.inf:  # also catches nan
            raise ConfigError(f"dist.comm_timeout={self.comm_timeout}: seconds >= 0 (0 = no watchdog)")
        if self.compress_start_step < 0:
            raise ConfigError(f"dist.compress_start_step={self.compress_start_step}: a step >= 0 (0 = compress "
                              f"from the first step)")
        from ..compress import make_compressor
        try:
            compressor = make_compressor(self.compress)
        except ValueError as exc:
            raise ConfigError(f"dist.compress={self.compress!r}: {str(exc).split(': ', 1)[-1]}") from None
        if self.tensor_parallel > 1 and compressor.combine == "gather":
            raise ConfigError(f"dist.compress={self.compress!r} with dist.tensor_parallel={self.tensor_parallel}: "
                              f"top-k and sign choose and scale entries over whole buckets, which mix split and "
                              f"replicated parameters, so the replicas on each tensor rank would drift apart; use "
                              f"fp16, bf16, randk or powersgd (per element, shared indices, or per layer)")
        if self.tensor_parallel < 1:
            raise ConfigError(f"dist.tensor_parallel={self.tensor_parallel}: a group size >= 1 (1 = no tensor "
                              f"parallelism)")
        if self.pipeline_parallel < 1:
            raise ConfigError(f"dist.pipeline_parallel={self.pipeline_parallel}: a number of stages >= 1 (1 = no "
                              f"pipeline parallelism)")
        from ..comm.zero import refusal
        why = refusal(self.zero, self.compress)
        if why:
            raise ConfigError(why)


@dataclass
class CheckpointConfig:
    dir: str = _f("runs/ckpt", "where checkpoints ckpt-<step>.h5 go (created if missing; every rank must see it)")
    every_steps: int = _f(0, "save every k steps; 0 = off")
    every_minutes: float = _f(30.0, "save when this many minutes passed since the last save (rank 0's clock); "
                              "0 = off")
    keep_last: int = _f(3, "keep the newest k checkpoints, delete older ones after a save; 0 = keep all")
    save_final: bool = _f(False, "save after the last step")
    resume: str = _f("", "\"\" = fresh start | auto = newest valid checkpoint in dir (fresh if none) | a file path; "
                     "also --resume")
    collective_io: bool = _f(False, "MPI-IO collective transfers for the data writes (independent writes of "
                             "large contiguous slices measured as fast here; try true on Lustre/GPFS)")
    writers_per_node: int = _f(0, "0 = every rank writes its own rows of a checkpoint; k = k ranks per node write, "
                               "the node's other ranks send them their rows over shared memory (no faster on "
                               "ext4 here: docs/benchmarks.md; try it where many writers to one file contend)")
    async_save: bool = _f(True, "periodic saves (every_steps, every_minutes) copy this rank's share aside and "
                          "write, check and commit it in the background while training goes on (the copy "
                          "holds host memory the size of the rank's share, kept between saves); a signal's and "
                          "the final save finish before the run goes on; false = every save stops training "
                          "until committed (better where training leaves no core idle: docs/checkpoint-format.md)")

    def validate(self):
        if self.writers_per_node < 0:
            raise ConfigError(f"checkpoint.writers_per_node={self.writers_per_node}: a number of ranks >= 1, "
                              f"or 0 = every rank writes")
        if self.every_steps < 0 or self.keep_last < 0:
            raise ConfigError(f"checkpoint.every_steps={self.every_steps} and checkpoint.keep_last="
                              f"{self.keep_last} must be >= 0")
        if not self.every_minutes >= 0 or math.isinf(self.every_minutes):  # also catches nan
            raise ConfigError(f"checkpoint.every_minutes={self.every_minutes}: a finite number >= 0")
        if not self.dir:
            raise ConfigError("checkpoint.dir is empty; name a directory (signals always save there)")


@dataclass
class GuardConfig:
    nonfinite: str = _f("abort", "a NaN/Inf loss or gradient (or a loss spike): abort (exit 5, nothing saved) | "
                        "skip (drop the step's update) | rollback (reload the last checkpoint, skip that batch)",
                        choices=("abort", "skip", "rollback"))
    check_grads: bool = _f(True, "also check the averaged gradients, not only the loss (one read of each bucket "
                           "on the communication thread; with shm's window, part of its fold)")
    spike_zscore: float = _f(0.0, "treat a step whose loss is this many standard deviations above the last "
                             "spike_window steps' as bad; 0 = off")
    spike_window: int = _f(100, "accepted steps the spike statistics look back on (no verdict before it fills)")
    max_bad_steps: int = _f(20, "abort (exit 5) once this many steps of the run were skipped or rolled back")

    def validate(self):
        if not 0 <= self.spike_zscore < math.inf:
            raise ConfigError(f"guard.spike_zscore={self.spike_zscore}: a number of standard deviations > 0, "
                              f"or 0 = off")
        if self.spike_window < 2 or self.max_bad_steps < 1:
            raise ConfigError(f"guard.spike_window={self.spike_window} must be >= 2 and guard.max_bad_steps="
                              f"{self.max_bad_steps} >= 1")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def validate(self) -> "Config":
        for section in dataclasses.fields(self):
            sub = getattr(self, section.name)
            for f in dataclasses.fields(sub):
                choices = f.metadata.get("choices")
                if choices and getattr(sub, f.name) not in choices:
                    raise ConfigError(f"{section.name}.{f.name}={getattr(sub, f.name)!r}: "
                                      f"choose one of {', '.join(map(str, choices))}")
            if hasattr(sub, "validate"):
                sub.validate()
        check_across_sections(self)
        return self

    def to_toml(self) -> str:
        """The resolved config as TOML text (printed by rank 0, stored in checkpoints)."""
        lines = []
        for section in dataclasses.fields(self):
            lines.append(f"[{section.name}]")
            for key, value in dataclasses.asdict(getattr(self, section.name)).items():
                lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        # JSON string escapes are valid TOML basic-string escapes; TOML also forbids a raw DEL
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def describe() -> str:
    """Every key with its default and reason, for ``--help-config``."""
    out = []
    for section in dataclasses.fields(Config):
        out.append(f"[{section.name}]")
        for f in dataclasses.fields(section.default_factory()):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append(f"  {f.name} = {_toml_value(default):<24} # {f.metadata['help']}")
    return "\n".join(out)
