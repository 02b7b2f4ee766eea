from __future__ import annotations

import os

# Small CPU models train faster on one thread, and parallel test workers share two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the planner and server tests run without torch
    pass
