"""Pipeline schedules (``dist.pipeline_schedule``): what each stage of a pipeline does in one step,
as a list of instructions, and a simulator that checks and times a schedule without running it.

With p stages and m micro-batches, stage s's list (:func:`stage_schedule`, run by
:class:`~.pipeline.PipelineStage`) holds only what it runs, each an :class:`Instr` of micro-batch i:

    recv_fwd i / send_fwd i   its input activation from stage s - 1 / its output to s + 1
    forward i                 the stage's forward (its activations kept for backward)
    recv_bwd i / send_bwd i   its output's gradient from stage s + 1 / its input's to s - 1
    backward i                the stage's backward (gradients added up; activations freed)

(no receive on stage 0 or send to it, none past the last stage.) ``gpipe`` runs every forward, then
every backward (Huang et al. 2019): a stage keeps all m micro-batches' activations. ``1f1b``
(PipeDream-Flush, Megatron-LM's non-interleaved schedule) runs min(p - s - 1, m) forwards ahead,
then alternates one forward and one backward, then drains: at most min(p - s, m) kept. Both idle
(p - 1) / (m + p - 1) of a step (:func:`bubble_fraction`). Messages are tagged by micro-batch, so
:func:`simulate` checks what an MPI run needs: every send has its receive on the neighbour, in the
same order, and no stage waits forever. :func:`check_config` refuses what a pipeline cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

SCHEDULES = ("gpipe", "1f1b")
KINDS = ("recv_fwd", "forward", "send_fwd", "recv_bwd", "backward", "send_bwd")
_SHORT = {"recv_fwd": "rF", "forward": "F", "send_fwd": "sF", "recv_bwd": "rB", "backward": "B", "send_bwd": "sB"}


@dataclass(frozen=True)
class Instr:
    """One instruction of a stage (see the module docstring): ``kind`` of micro-batch ``micro``."""

    kind: str
    micro: int

    def __str__(self) -> str:
        return _SHORT[self.kind] + str(self.micro)


def _forward(stage: int, p: int, i: int) -> list[Instr]:
    out = [] if stage == 0 else [Instr("recv_fwd", i)]
    out.append(Instr("forward", i))
    if stage < p - 1:
        out.append(Instr("send_fwd", i))
    return out


def _backward(stage: int, p: int, i: int) -> list[Instr]:
    out = [] if stage == p - 1 else [Instr("recv_bwd", i)]
    out.append(Instr("backward", i))
    if stage > 0:
        out.append(Instr("send_bwd", i))
    return out


def stage_schedule(name: str, stage: int, p: int, m: int) -> list[Instr]:
    """The instructions of ``stage`` (0 .. p-1) of schedule ``name`` for ``m`` micro-batches."""
    if name not in SCHEDULES:
        raise ConfigError(f"dist.pipeline_schedule={name!r}: choose one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or not 0 <= stage < p:
        raise ValueError(f"stage {stage} of {p} stage(s), {m} micro-batch(es)")
    out: list[Instr] = []
    if name == "gpipe":
        for i in range(m):
            out += _forward(stage, p, i)
        for i in range(m):
            out += _backward(stage, p, i)
    else:
        ahead = min(p - stage - 1, m)
        for i in range(ahead):
            out += _forward(stage, p, i)
        for i in range(m - ahead):   # steady state: forward i + ahead, then backward i
            out += _forward(stage, p, i + ahead)
            out += _backward(stage, p, i)
        for i in range(m - ahead, m):
            out += _backward(stage, p, i)
    return out


def schedule(name: str, p: int, m: int) -> list[list[Instr]]:
    """Every stage's instructions, stage 0 first."""
    return [stage_schedule(name, s, p, m) for s in range(p)]


def describe(name: str, p: int, m: int, compute_only: bool = False) -> str:
    """The schedule printed one stage a line (``info`` and the docs): with ``compute_only``, just the
    forwards (F) and backwards (B); else the sends (s) and receives (r) too."""
    lines = [f"{name}, {p} stage(s), {m} micro-batch(es):"]
    for s, instrs in enumerate(schedule(name, p, m)):
        shown = [str(x) for x in instrs if not compute_only or x.kind in ("forward", "backward")]
        lines.append(f"  stage {s}: " + " ".join(shown))
    return "\n".join(lines)


@dataclass
class Simulated:
    """What :func:`simulate` found: the step's time, each stage's busy time and idle fraction, and the
    most micro-batches whose activations each stage held at once."""

    time: float
    busy: list
    idle_fraction: list
    peak_in_flight: list


class ScheduleError(RuntimeError):
    """A schedule that would deadlock or mismatch its messages under MPI."""


def simulate(stages: list[list[Instr]], forward_time: float = 1.0, backward_time: float = 2.0) -> Simulated:
    """Run ``stages`` (from :func:`schedule`) on a clock: each forward takes ``forward_time``, each
    backward ``backward_time``, messages take no time; a send never waits, a receive
    waits for its send. Raises :class:`ScheduleError` if a receive has no matching send (wrong
    micro-batch or order) or no stage can go on before all are done (a deadlock)."""
    p = len(stages)
    pos = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    # messages in flight per (from, to, kind): (micro-batch, time sent), in send order
    channels: dict = {}
    held, peak = [0] * p, [0] * p
    while any(pos[s] < len(stages[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(stages[s]):
                x = stages[s][pos[s]]
                if x.kind in ("recv_fwd", "recv_bwd"):
                    src = s - 1 if x.kind == "recv_fwd" else s + 1
                    if not 0 <= src < p:
                        raise ScheduleError(f"stage {s}: {x} has no neighbour to receive from")
                    queue = channels.get((src, s, x.kind[5:]), [])
                    if not queue:
                        break   # waits for the send
                    micro, sent = queue.pop(0)
                    if micro != x.micro:
                        raise ScheduleError(f"stage {s}: {x} would receive micro-batch {micro} (messages arrive "
                                            f"in send order)")
                    clock[s] = max(clock[s], sent)
                elif x.kind in ("send_fwd", "send_bwd"):
                    dst = s + 1 if x.kind == "send_fwd" else s - 1
                    if not 0 <= dst < p:
                        raise ScheduleError(f"stage {s}: {x} has no neighbour to send to")
                    channels.setdefault((s, dst, x.kind[5:]), []).append((x.micro, clock[s]))
                elif x.kind in ("forward", "backward"):
                    t = forward_time if x.kind == "forward" else backward_time
                    clock[s] += t
                    busy[s] += t
                    held[s] += 1 if x.kind == "forward" else -1
                    peak[s] = max(peak[s], held[s])
                pos[s] += 1
                progressed = True
        if not progressed:
            waiting = {s: str(stages[s][pos[s]]) for s in range(p) if pos[s] < len(stages[s])}
            raise ScheduleError(f"deadlock: every unfinished stage waits ({waiting})")
    leftover = {k: v for k, v in channels.items() if v}
    if leftover:
        raise ScheduleError(f"messages never received: {leftover}")
    if any(held):
        raise ScheduleError(f"activations never freed by a backward: {held}")
    total = max(clock)
    return Simulated(total, busy, [1.0 - b / total for b in busy], peak)


def bubble_fraction(p: int, m: int) -> float:
    """The idle fraction of each stage in a step of either schedule: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


def check_config(cfg) -> None:
    """:class:`ConfigError` for a pipeline (``dist.pipeline_parallel`` > 1 or ``dist.pipeline_stages``)
    that this configuration cannot run; what a world size decides is checked by the grid."""
    d, m = cfg.dist, cfg.model
    p = d.pipeline_parallel
    if m.kind != "gpt":
        raise ConfigError(f"dist.pipeline_parallel={p}: pipeline stages are the GPT's blocks; model.kind = "
                          f"{m.kind!r} trains data-parallel only (its two hidden layers are smaller than one "
                          f"stage boundary's activations would be worth sending)")
    if p > m.n_layer:
        raise ConfigError(f"dist.pipeline_parallel={p} exceeds model.n_layer={m.n_layer}: each stage holds at "
                          f"least one block")
    if d.pipeline_stages:
        stages = list(d.pipeline_stages)
        if len(stages) != p or any(not isinstance(n, int) or n < 1 for n in stages) or sum(stages) != m.n_layer:
            raise ConfigError(f"dist.pipeline_stages={stages}: {p} block count(s) >= 1 (one per stage of "
                              f"dist.pipeline_parallel={p}) adding up to model.n_layer={m.n_layer}, or [] to "
                              f"balance by parameter count")
    if p > 1 and d.compress != "none":
        raise ConfigError(f"dist.compress={d.compress!r} with dist.pipeline_parallel={p}: a compressor's state "
                          f"(residuals, PowerSGD's factors) is saved per rank, and a pipeline's stages hold "
                          f"different parameters; use one of them")
