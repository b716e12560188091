"""Test tools, opt-in: nothing in hpctrain imports this package.

  simulator.py   numba's CUDA simulator made safe for concurrent launches (the tests, the benchmarks
                 on the simulator and ``python -m hpctrain.testing`` apply it)
  __main__.py    ``python -m hpctrain.testing <command> ...``: ``python -m hpctrain`` with the
                 simulator made safe first (scripts/gpu-check.sh --simulate)
"""
