"""Training data: formats, samplers and generators.

  tabular.py   the classification format (/x float [N, D], /y int [N]), its checks, batch reading
  tokens.py    the token format (/train, /val streams): its checks, memory-mapping, windows, batch reading
  sampler.py   which rows (or token windows) each rank reads at each step; evaluation shards
  synth.py     a learnable synthetic classification set (teacher network)
  text.py      byte-level token files from text (default: the Python standard library), split and baselines
  importer.py  NumPy arrays (x, y) -> the classification format (``data import``)
"""

from .sampler import DistributedSampler, per_rank_batch, shard_range
from .tabular import BatchReader, Dataset, open_dataset, read_rows
from .tokens import TokenBatchReader, TokenData, TokenWindows, eval_indices, open_tokens

__all__ = ["BatchReader", "Dataset", "DistributedSampler", "TokenBatchReader", "TokenData", "TokenWindows",
           "eval_indices", "open_dataset", "open_tokens", "per_rank_batch", "read_rows", "shard_range"]
