"""``attach``'s options, checked once where they are made and handed down whole."""

from __future__ import annotations

from dataclasses import dataclass

from rematd.client.blocks.compress import CompressConfig
from rematd.client.blocks.offload import OffloadConfig
from rematd.client.service.stream_config import StreamConfig
from rematd.planner import Mode


@dataclass(frozen=True, slots=True, kw_only=True)
class AttachOptions:
    """What ``attach`` was asked for, each value checked and in the form the handle uses (the model, its blocks
    and its optimizer aside: objects the handle holds, not settings). Combinations that cannot work are refused
    here, naming the setting to change; nothing below checks them again."""

    server: str | None = None
    """The service's gRPC target; None plans in this process."""
    stream: StreamConfig | None = None
    """How the stream to the service connects (token, TLS, fallback); only with ``server``."""
    job: str | None = None
    """The job's name on the service, as given (None: a random one is made)."""
    budget_bytes: int | None = None
    """The memory budget (None: the device's, or on the CPU the host's)."""
    margin_ratio: float = 0.1
    """The fraction of the budget the planner keeps free, in [0, 1)."""
    modes: frozenset[Mode]
    """The modes a plan may use (store always among them)."""
    hard_limit_bytes: int | None = None
    """On the CPU, the bytes saved for backward a step may not cross."""
    compile_backend: str | None = None
    """The ``torch.compile`` backend each block's variants are compiled with (None: eager)."""
    same_plan: bool | None = None
    """Whether the ranks that share the parameters run one plan (None: where the set-up needs it)."""
    compress: CompressConfig | None = None
    """How the compress mode keeps activations, when given."""
    offload: OffloadConfig | None = None
    """How the offload mode moves activations, when given."""
    planner_thread: bool = True
    """In-process planning on a thread of its own (else on the training thread, at each step's end)."""

    def __post_init__(self) -> None:
        if self.server is not None and not self.planner_thread:
            raise ValueError(
                "planner_thread=False plans in this process, on the training thread; with server= the service "
                "plans: drop one of them"
            )
        if self.compress is not None and Mode.COMPRESS not in self.modes:
            raise ValueError("compress= configures the 'compress' mode, which modes= does not enable: add 'compress'")
        if self.offload is not None and Mode.OFFLOAD not in self.modes:
            raise ValueError("offload= configures the 'offload' mode, which modes= does not enable: add 'offload'")
