"""Parallel HDF5 checkpoints: atomic, verifiable, resumable at any world size.

  format   file names, layout constants, CRC-32 and its combination
  state    the trainer's state as named logical arrays, and back
  write    the parallel write protocol (h5py ``mpio``) and the atomic commit
  slices   a rank's share of the data: pieces, transfers, checksums while syncing
  read     verification and the parallel load
  checks   what a valid file is beyond its CRCs: header, layout, the errors
  probe    a child process decodes a file's metadata first (HDF5 may crash or loop on a corrupt one)
  manager  when to save, what to resume from, keep_last
  signals  SIGUSR1 / SIGTERM -> save and exit
  cli      ``python -m hpctrain ckpt ls|verify|inspect``

The file format is documented in docs/checkpoint-format.md.
"""
