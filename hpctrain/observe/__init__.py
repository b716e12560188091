"""Observation: the rank-0 log and metrics, traces, per-op times, MFU, memory accounting, ``info``
and the benchmark reports."""
