"""Training data: formats, samplers and generators.

  tabular.py   the classification format (/x float [N, D], /y int [N]), its checks, batch reading
  sampler.py   which rows (or token windows) each rank reads at each step; evaluation shards
  synth.py     a learnable synthetic classification set (teacher network)
"""

from .sampler import DistributedSampler, per_rank_batch, shard_range
from .tabular import BatchReader, Dataset, open_dataset, read_rows

__all__ = ["BatchReader", "Dataset", "DistributedSampler", "open_dataset", "per_rank_batch", "read_rows",
           "shard_range"]
