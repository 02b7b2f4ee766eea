"""rematd's client: attach it to a model and it applies checkpoint plans between steps.

from rematd import client
h = client.attach(model, optimizer=opt)   # or h.step() after opt.step()
"""

from rematd.client.attach import attach
from rematd.client.blocks.compiled import CompileStats
from rematd.client.blocks.compress import CompressConfig
from rematd.client.blocks.discovery import BlockDiscoveryError, find_blocks
from rematd.client.blocks.offload import OffloadConfig
from rematd.client.errors import OutOfMemory, UnsupportedModel
from rematd.client.handle import Handle
from rematd.client.service.stream_config import StreamConfig
from rematd.client.steps.oom import Guard
from rematd.planner import Plan

__all__ = [
    "BlockDiscoveryError",
    "CompileStats",
    "CompressConfig",
    "Guard",
    "Handle",
    "OffloadConfig",
    "OutOfMemory",
    "Plan",
    "StreamConfig",
    "UnsupportedModel",
    "attach",
    "find_blocks",
]
