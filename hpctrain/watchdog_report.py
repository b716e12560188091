"""The stall watchdog's report: one headline, then who waits, who is elsewhere, who did not answer."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the watchdog imports this module
    from .watchdog import Region


def diagnose(r: Region, waited: float, me: int, size: int, replies: dict, grace: float, asked: bool) -> str:
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
    silent = [q for q in range(size) if q != me and q not in replies]
    if silent:
        lines.append(f"  no answer within {grace:g} s from {ranks_text(silent)}: stopped (SIGSTOP, a debugger), dead, "
                     f"or hung outside Python (I/O, a driver call); those ranks are the likely cause")
    return "\n".join(lines)


def ranks_text(ranks) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(q) for q in ranks)
