"""Reliability: failing together, the numeric guard, the stall watchdog, stop signals, fault injection,
the restarting launcher and its back-ends, the SLURM environment and the progress marks it reads."""
