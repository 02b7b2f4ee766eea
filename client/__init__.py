"""rematd's client: attach it to a model and it applies checkpoint plans between steps.

from rematd import client
h = client.attach(model, optimizer=opt)   # or h.step() after opt.step()
"""

from rematd.client.discovery import BlockDiscoveryError, find_blocks
from rematd.client.guard import OutOfMemory, UnsupportedModel
from rematd.client.handle import Guard, Handle, attach
from rematd.client.stream import StreamConfig
from rematd.planner import Plan

__all__ = [
    "BlockDiscoveryError",
    "Guard",
    "Handle",
    "OutOfMemory",
    "Plan",
    "StreamConfig",
    "UnsupportedModel",
    "attach",
    "find_blocks",
]
