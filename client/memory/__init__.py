"""Memory figures: bytes saved for backward counted per storage, and where a step's figures come from (the CUDA
allocator, or that counting on the CPU)."""
