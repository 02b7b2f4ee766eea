"""rematd's client: attach it to a model and it applies checkpoint plans between steps.

from rematd import client
h = client.attach(model, optimizer=opt)   # or h.step() after opt.step()
"""

from rematd.client.attach import attach
from rematd.client.compiled import CompileStats
from rematd.client.compress import CompressConfig
from rematd.client.connection import StreamConfig
from rematd.client.discovery import BlockDiscoveryError, find_blocks
from rematd.client.errors import OutOfMemory, UnsupportedModel
from rematd.client.guard import Guard
from rematd.client.handle import Handle
from rematd.planner import Plan

__all__ = [
    "BlockDiscoveryError",
    "CompileStats",
    "CompressConfig",
    "Guard",
    "Handle",
    "OutOfMemory",
    "Plan",
    "StreamConfig",
    "UnsupportedModel",
    "attach",
    "find_blocks",
]
