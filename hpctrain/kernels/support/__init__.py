"""What the ops share: launch geometry and the simulator switch, the CPU twins' threads and exp,
cuBLAS through CuPy and strided-batched GEMMs (one module each)."""
