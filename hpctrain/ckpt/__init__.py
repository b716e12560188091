"""Parallel HDF5 checkpoints: atomic, verifiable, resumable at any world size.

  format   file names, layout constants, CRC-32 and its combination
  crc      a dataset's CRC-32 from the boxes many ranks wrote (one XOR all-reduce)
  boxes    a rank's flat ranges as hyperslabs of the logical arrays (tensor pieces included)
  ownership who writes which part and which parts a rank reads back (ZeRO, tensor, pipeline, data)
  state    the training state as named logical arrays, and back
  write    the parallel write protocol (h5py ``mpio``) and the atomic commit
  slices   a rank's share of the data: its boxes, transfers, checksums as it writes
  aggregate  writer ranks per node that write their node's other ranks' rows (writers_per_node)
  read     verification and the parallel load
  checks   what a valid file is beyond its CRCs: header, layout, the errors
  isolated HDF5 decodes a file only in a child process (it may crash, loop or blow up on a corrupt one)
  decode   what that child runs: verify, header, inspect, a rank's share or boxes into shared memory
  share    a rank's share of a file, read by such a child into memory the parent maps
  manager  when to save (in the background with async_save), what to resume from, keep_last
  cli      ``python -m hpctrain ckpt ls|verify|inspect``

The file format is documented in docs/checkpoint-format.md.
"""
