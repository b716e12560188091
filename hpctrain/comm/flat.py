"""The strategies that reduce over one communicator, by name: what hierarchical runs across nodes
(and on one node) and what auto measures beside it. The package's ``STRATEGIES`` adds hierarchical."""

from .mpi_allreduce import MpiAllreduce
from .naive import NaiveAllreduce
from .rhd import RhdAllreduce
from .ring import RingAllreduce
from .shm import ShmAllreduce

FLAT = {"mpi": MpiAllreduce, "naive": NaiveAllreduce, "ring": RingAllreduce, "rhd": RhdAllreduce,
        "shm": ShmAllreduce}
