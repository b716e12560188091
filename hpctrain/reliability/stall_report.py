"""The stall watchdog's report: one headline, then who waits, who is elsewhere, who did not answer.

Plain functions of what the ranks answered (:mod:`.watchdog` asks them), so a report reads the
same whichever rank prints it.
"""

from __future__ import annotations


def diagnose(r, waited: float, me: int, size: int, replies: dict, grace: float, asked: bool) -> str:
    """The report on region ``r`` by rank ``me`` after ``waited`` s, from the ``replies``
    (rank -> status) of the ranks that answered within ``grace`` s; ``asked``: whether they
    could be asked at all (MPI_THREAD_MULTIPLE)."""
    lines = [f"hpctrain: watchdog: {r.describe()} has not completed after {waited:.1f} s "
             f"(limit {r.limit:g} s: dist.comm_timeout); aborting all {size} ranks"]
    if not asked:
        lines.append("  the other ranks were not asked (MPI thread level below MULTIPLE); look for the rank "
                     "that stopped, e.g. with py-spy dump or gdb on each node")
        return "\n".join(lines)
    waiting = sorted([me] + [s.rank for s in replies.values() if s.inside and s.seq == r.seq])
    lines.append(f"  waiting in it: {ranks_text(waiting)}")
    for s in sorted(replies.values(), key=lambda s: s.rank):
        if s.inside and s.seq == r.seq:
            continue
        if s.inside:
            lines.append(f"  rank {s.rank}: elsewhere, in {s.where} for {s.seconds:.1f} s (collective #{s.seq}, "
                         f"this one is #{r.seq})")
        elif s.seq == 0:
            lines.append(f"  rank {s.rank}: not in a collective; in none yet, {s.seconds:.1f} s after its watchdog "
                         f"started (busy or stuck in its own start-up code)")
        else:
            lines.append(f"  rank {s.rank}: not in a collective; left {s.where} (#{s.seq}) {s.seconds:.1f} s ago "
                         f"(busy or stuck in its own code)")
    return "\n".join(lines + _silent_lines(me, size, replies, grace))


def _silent_lines(me: int, size: int, replies: dict, grace: float) -> list[str]:
    """The line naming the ranks that did not answer (none when every rank did)."""
    silent = [q for q in range(size) if q != me and q not in replies]
    if not silent:
        return []
    return [f"  no answer within {grace:g} s from {ranks_text(silent)}: stopped (SIGSTOP, a debugger), dead, "
            f"or hung outside Python (I/O, a driver call); those ranks are the likely cause"]


def ranks_text(ranks) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(q) for q in ranks)


def diagnose_background(b, waited: float, me: int, size: int, replies: dict, grace: float, asked: bool) -> str:
    """The report on ``b``, a collective task of a thread of its own (a checkpoint written in the
    background), still running after ``waited`` s on rank ``me``: which ranks are still in it,
    which have finished it, which did not answer."""
    lines = [f"hpctrain: watchdog: {b.describe()} has not completed after {waited:.1f} s "
             f"(limit {b.limit:g} s: dist.comm_timeout); aborting all {size} ranks"]
    if not asked:
        return "\n".join(lines)
    inside = sorted([me] + [s.rank for s in replies.values() if s.background == b.describe()])
    lines.append(f"  still in it: {ranks_text(inside)}")
    done = sorted(s.rank for s in replies.values() if s.background != b.describe())
    if done:
        lines.append(f"  done with it (or never in it): {ranks_text(done)}; the ranks still in it wait for a "
                     f"file system call or for each other")
    return "\n".join(lines + _silent_lines(me, size, replies, grace))
