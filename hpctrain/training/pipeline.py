"""A pipeline stage's micro-batches: the schedule's instructions run with MPI point-to-point.

With ``dist.pipeline_parallel = p`` each rank holds one stage of the GPT (:mod:`hpctrain.models.gpt_layers`)
and :class:`PipelineStage` runs its instruction list for the step (:func:`~.schedules.stage_schedule`,
GPipe or 1F1B over m = ``train.grad_accum_steps`` micro-batches): ``forward i`` on lane i mod L (L:
the most micro-batches the schedule keeps in flight here; each lane holds its own activations),
``backward i`` the other way (the last backward feeds the gradient buckets; every backward under
ZeRO-2), sends and receives between neighbouring stages. Sends are ``MPI_Isend`` from the lane's
own buffer, waited for before it is written again; receives are ``MPI_Irecv`` posted as soon as no
instruction still uses the buffer they fill (:func:`receive_posts`), each neighbour's in order and
through pinned host buffers two at a time at most, and waited for, watched, where their data is
needed. Messages are tagged by micro-batch on the pipeline group's own communicator; device buffers
reach MPI through :class:`~hpctrain.comm.staging.Staging`. The ``pipeline`` phase of the timers is
the step's time in messages (the bubble); ``busy`` is the stage's compute by the host's clock
(docs/pipeline.md).
"""

from __future__ import annotations

import time

import numpy as np

from ..comm.staging import Staging
from ..data.sampler import shard_range
from .schedules import stage_schedule


# the instructions that use the buffer a receive fills, by the receive's kind: the lane's received
# residual stream (read by its forward, and by its backward through the first block's cached input),
# and the lane's stream gradient (written by its backward in place, then sent on from there)
_USES = {"recv_fwd": ("recv_fwd", "forward", "backward"), "recv_bwd": ("recv_bwd", "backward", "send_bwd")}


def receive_posts(instrs, lanes: int) -> dict:
    """For each receive of ``instrs`` (by index), the index of the last instruction before it that uses
    the buffer it fills (-1: none): from then on the receive can be posted (``MPI_Irecv``) ahead of
    the instruction that needs its data. Lane ``i mod lanes`` holds micro-batch i's buffers."""
    out = {}
    for q, x in enumerate(instrs):
        if x.kind in _USES:
            k = x.micro % lanes
            out[q] = max((r for r in range(q) if instrs[r].micro % lanes == k and instrs[r].kind in _USES[x.kind]
                          and instrs[r].micro >= 0), default=-1)
    return out


def in_flight(instrs) -> int:
    """The most micro-batches whose activations a stage's instruction list holds at once."""
    held = peak = 0
    for x in instrs:
        held += (x.kind == "forward") - (x.kind == "backward")
        peak = max(peak, held)
    return peak


class PipelineStage:
    """This rank's stage of the pipeline ``plan`` lays out, over ``model`` (a GPT stage); ``fetch``:
    ZeRO-3's parameter gathers (:meth:`~hpctrain.comm.zero_params.ParameterSlots.fetch`), or None.
    Builds a duplicate of the pipeline group's communicator (collective over the pipeline group)."""

    def __init__(self, plan, model, timers, watchdog, fetch=None):
        grid, cfg = plan.grid, plan.cfg
        self.plan, self.model, self.timers, self.watchdog, self.fetch = plan, model, timers, watchdog, fetch
        self.p, self.stage, self.m = grid.p, grid.stage, plan.micro_batches
        self.instrs = stage_schedule(cfg.dist.pipeline_schedule, self.stage, self.p, self.m)
        self.lanes = in_flight(self.instrs)   # = plan.in_flight
        self.posts = receive_posts(self.instrs, self.lanes)
        self.comm = grid.pipeline.comm.Dup()   # point-to-point messages of this pipeline only
        self.staging = Staging(plan.device, cfg.dist.cuda_aware_mpi)
        self._inputs: dict = {}    # (lane, shape) -> the residual stream received
        self._grads: dict = {}     # (lane, shape) -> the stream's gradient (received, or the loss's)
        self._outputs: dict = {}   # lane -> the residual stream forward sent on
        self._sends: dict = {}     # (lane, "fwd" | "bwd") -> the send in flight from that lane's buffer
        self.bytes_sent = 0        # this rank's bytes of the last step: point-to-point, and the tied table's sum
        self.busy = self.wall = 0.0   # the last step's seconds in forward and backward, first to last instruction

    def run(self, step: int, x_all, y_all, totals, ready, claim, every_micro: bool = False,
            loss_scale: float = 1.0) -> None:
        """The stage's forwards and backwards of global step ``step`` (this data rank's rows ``x_all``,
        ``y_all``, host arrays; each stage reads the same and uses what it needs). The last stage adds
        each micro-batch's (loss_sum, correct) to ``totals``, its loss's gradient times ``loss_scale``;
        ``ready``/``claim``: the gradient reducer's, passed to the last backward (every backward with
        ``every_micro``, ZeRO-2)."""
        model, dev, t = self.model, self.plan.device, self.timers
        first, last = self.stage == 0, self.stage == self.p - 1
        parts = [slice(*shard_range(len(y_all), i, self.m)) for i in range(self.m)]
        model.flat.refresh_compute()   # a 16-bit precision's parameter copy, from this step's masters
        self.bytes_sent = 0
        shape_of = lambda i: ((parts[i].stop - parts[i].start) * y_all.shape[1], model.d_model)  # noqa: E731
        self._pending, self._posted, self._pinned_free = sorted(self.posts), {}, {}
        backwards, busy, t_start = 0, 0.0, time.perf_counter()
        self._post_free(-1, shape_of, force=None)
        for q, x in enumerate(self.instrs):
            i = x.micro
            k = i % self.lanes
            lane = model.lane(k)
            if x.kind in ("recv_fwd", "recv_bwd", "send_fwd", "send_bwd"):
                shape = shape_of(i)
            if x.kind in ("recv_fwd", "recv_bwd"):
                if q not in self._posted:   # its buffer's send still in flight at every check before
                    self._post_free(q - 1, shape_of, force=q)
                self._complete(q, step)
            elif x.kind == "forward":
                self._wait(k, "fwd")   # the lane's output is written again
                t0 = time.perf_counter()   # (with train.sync_phases the timer's device wait counts as busy)
                with t("forward"):
                    if first:
                        inp = dev.upload(x_all[parts[i]], f"x{k}", model.input_dtype)
                        B, T = inp.shape
                    else:
                        B, T = parts[i].stop - parts[i].start, y_all.shape[1]
                        inp = self._inputs[k, (B * T, model.d_model)]
                    out = lane.forward(inp, B, T, self.fetch)
                    if last:
                        y = dev.upload(y_all[parts[i]], f"y{k}", np.int64)
                        lane.loss.forward(out, y.reshape(-1), totals, i > 0, loss_scale)
                    else:
                        self._outputs[k] = out
                busy += time.perf_counter() - t0
            elif x.kind == "send_fwd":
                self._send(self._outputs[k], self.stage + 1, i, (k, "fwd"))
            elif x.kind == "backward":
                self._wait(k, "bwd")   # the lane's gradient buffer is written again
                t0 = time.perf_counter()
                with t("backward"):
                    shape = lane.blocks[0].x.shape
                    dres = self._buffer(self._grads, k, shape)
                    final = backwards == self.m - 1
                    lane.backward(dres, accumulate=backwards > 0 and not every_micro,
                                  ready=ready if final or every_micro else None, claim=claim, fetch=self.fetch)
                busy += time.perf_counter() - t0
                backwards += 1
            elif x.kind == "send_bwd":
                self._send(self._grads[k, shape], self.stage - 1, i, (k, "bwd"))
            if self._pending:
                self._post_free(q, shape_of)
        for key in list(self._sends):
            self._wait(*key)
        self.busy, self.wall = busy, time.perf_counter() - t_start

    def sum_tied(self, grad, step: int) -> None:
        """The tied table's gradient ``grad`` (this rank's part of it, averaged over its data group)
        summed with the other end's: the first stage's (from the embedding) and the last's (from the
        head). The sum of two is the same bits on both, so their copies of the table stay equal.
        Collective over the embedding group (the first and last stage)."""
        from mpi4py import MPI

        with self.timers("allreduce"), self.watchdog.watch("embedding-group all-reduce", f"wte, step {step}", step):
            with self.staging.mpi_view(grad, "tied") as view:
                self.plan.grid.embedding.comm.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)
        self.bytes_sent += grad.nbytes   # to the other end of the embedding group

    def held_activation_bytes(self) -> int:
        """Bytes of the activations this stage holds for its micro-batches in flight: the lanes'
        arrays and the residual streams received for them (a first stage's embedding output)."""
        received = sum(buf.nbytes for (k, _), buf in self._inputs.items() if k != "eval")
        return self.model.held_activation_bytes() + received

    def metrics(self) -> dict:
        """The last step's pipeline figures for the metrics, every stage's (by the host's clock):
        ``pipeline_span``, the first stage's seconds from its first to its last instruction (it starts
        the first forward and ends the last backward: the schedule's length); ``pipeline_busy``, the
        seconds each stage computed (forward and backward); ``pipeline_idle``, the fraction of the
        span each did not (the bubble, with any imbalance between the stages); the activation bytes
        each holds; this rank's bytes sent (point-to-point, and on the first and last stage the tied
        table's gradient to the other). Collective over the pipeline group."""
        stages = self.comm.allgather((self.busy, self.wall, self.held_activation_bytes()))
        span = stages[0][1]
        return {"pipeline_span": span, "pipeline_busy": [busy for busy, _, _ in stages],
                "pipeline_idle": [round(1.0 - busy / span, 4) if span > 0 else 0.0 for busy, _, _ in stages],
                "pipeline_activation_bytes": [held for _, _, held in stages], "pipeline_bytes_sent": self.bytes_sent}

    def score(self, x_host, y_host):
        """A forward of the evaluation rows through every stage in turn (lane 0, blocking messages):
        (loss_sum, correct) on the last stage, (0, 0) on the others."""
        model, dev = self.model, self.plan.device
        B, T = y_host.shape
        shape = (B * T, model.d_model)
        model.flat.refresh_compute()
        if self.stage == 0:
            inp = dev.upload(x_host, "eval_x", model.input_dtype)
        else:
            inp = self._buffer(self._inputs, "eval", shape)
            self._receive(inp, "evaluation activations")
        out = model.lane(0).forward(inp, B, T, self.fetch)
        if self.stage < self.p - 1:
            with self.staging.send_view(out, "eval") as view:
                self.comm.Send(view, dest=self.stage + 1, tag=0)
            return 0.0, 0
        y = dev.upload(y_host, "eval_y", np.int64)
        return model.loss.forward(out, y.reshape(-1))

    # ---- messages ------------------------------------------------------------------
    def _buffer(self, table: dict, k, shape):
        buf = table.get((k, shape))
        if buf is None:   # the residual stream and its gradient: full precision (hpctrain.precision)
            buf = table[k, shape] = self.model.device.empty(shape, self.model.device.accum_dtype)
        return buf

    def _post_free(self, done: int, shape_of, force=None) -> None:
        """Post (``MPI_Irecv``) the pending receives, each source's in instruction order, while the next
        one's buffer is free: no instruction up to index ``done`` still uses it, no send still reads it
        (a send in flight is tested, which also moves MPI on) and, through pinned host buffers, one of
        the source's two is free (so at most two receives' worth of pinned memory per neighbour, and
        a receive completes before the one posted after it). With ``force``, that receive at the
        latest, waiting for its buffer's send."""
        blocked = set()   # sources whose next receive cannot be posted yet
        for q in list(self._pending):
            x = self.instrs[q]
            fwd = x.kind == "recv_fwd"
            source = self.stage - 1 if fwd else self.stage + 1
            if source in blocked:
                continue
            k = x.micro % self.lanes
            free = self._pinned_free.setdefault(source, [0, 1])
            if self.posts[q] > done or self.staging.mode == "pinned" and not free:
                blocked.add(source)
                continue
            if not fwd:   # the lane's gradient buffer: the send from it (if any) completes first
                req = self._sends.get((k, "bwd"))
                if req is not None and q != force and not req.Test():
                    blocked.add(source)
                    continue
                self._wait(k, "bwd")
            buf = self._buffer(self._inputs if fwd else self._grads, k, shape_of(x.micro))
            start = lambda view, source=source, tag=x.micro: self.comm.Irecv(view, source=source, tag=tag)  # noqa: E731
            slot = free.pop(0) if self.staging.mode == "pinned" else k
            with self.timers("pipeline"):
                self._posted[q] = (self.staging.post_recv(buf, start, ("recv", source, slot)), source, slot)
            self._pending.remove(q)

    def _complete(self, q: int, step: int) -> None:
        """Wait (watched, in the ``pipeline`` phase: the bubble) for the posted receive of instruction ``q``."""
        x = self.instrs[q]
        what = "activations" if x.kind == "recv_fwd" else "gradients"
        posted, source, slot = self._posted.pop(q)
        with self.timers("pipeline"), self.watchdog.watch(
                "pipeline receive", f"stage {self.stage} waits for micro-batch {x.micro}'s {what} from stage {source}, "
                f"step {step}", step):
            posted.wait()
        if self.staging.mode == "pinned":
            self._pinned_free[source].append(slot)

    def _receive(self, buf, what: str) -> None:
        """A blocking receive into ``buf`` from the stage before (an evaluation's), watched."""
        source = self.stage - 1
        with self.watchdog.watch("pipeline receive", f"stage {self.stage} waits for the {what} from stage {source}", 0):
            with self.staging.recv_view(buf, ("recv", source)) as view:
                self.comm.Recv(view, source=source, tag=0)

    def _send(self, buf, dest: int, micro: int, key) -> None:
        with self.timers("pipeline"):
            with self.staging.send_view(buf, key) as view:
                self._sends[key] = self.comm.Isend(view, dest=dest, tag=micro)
            self.bytes_sent += buf.nbytes

    def _wait(self, k, kind) -> None:
        """Wait for the send in flight from lane ``k``'s ``kind`` buffer, if any (the ``pipeline`` phase)."""
        req = self._sends.pop((k, kind), None)
        if req is not None:
            with self.timers("pipeline"):
                req.Wait()
