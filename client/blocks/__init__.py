"""The model's blocks: finding them, the switchable wrapper around each, and the modes a block runs in (stored,
selective, recomputed, offloaded, compressed, compiled), with what a mode costs measured per block."""
