"""hpctrain: data-parallel neural-network training for HPC clusters.

Importing the package has no side effects: MPI is initialised by
:func:`hpctrain.runtime.init_world`, and CUDA only when a cuda device is made.
"""

__version__ = "0.1.0"
