"""rematd as one more activation-checkpointing mode of torchtitan's own trainer.

    torchrun --nproc-per-node 8 -m rematd.integrations.torchtitan --module llama3 --config llama3_8b \\
        --training.disable-cuda-graphs activation-checkpoint:rematd --activation-checkpoint.budget-bytes 60000000000

Everything before ``activation-checkpoint:rematd`` is torchtitan's own command line, unchanged; the
``--activation-checkpoint.*`` flags after it are rematd's (``... activation-checkpoint:rematd --help``
lists them). The trainer is torchtitan's ``Trainer`` with one more choice in its activation-checkpoint
union: torchtitan applies it where it applies its own checkpointing (each model part's parallelize
function: tensor parallel, then checkpointing, then compile, then FSDP), so rematd attaches to the model's
blocks at that point. Under pipeline parallel each stage's blocks are taken there too, and attached once the
trainer has built its schedule, one handle following the schedule for all the rank's stages (the client plans
each stage for the microbatches the schedule keeps alive on it). Each handle ends its steps after the step of
the optimizer that owns its parts' parameters, and closes with the trainer. Without ``--activation-checkpoint.server``
each rank plans in its own process on the planner's thread (``attach``'s default): the training thread hands
over a step's figures and never waits for a plan, which runs from the first step it is ready for (until the
first, every block recomputes, as profiling did; ranks that agree on plans run the leanest any of them has).

Refused at start, naming the flag to change: a torchtitan release other than :data:`SUPPORTED`; torchtitan
compiling the blocks itself (``--compile.enable`` with ``model`` in ``--compile.components``): rematd
compiles them with its modes inside (``--activation-checkpoint.compile``); CUDA graphs (torchtitan's default
on NVIDIA GPUs), which would replay one plan forever (``--training.disable-cuda-graphs``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeAlias

SUPPORTED = ("0.3.0",)
"""The torchtitan releases this integration was built and tested against."""


def check_version(found: str) -> None:
    """RuntimeError unless ``found`` (``torchtitan.__version__``) is one of :data:`SUPPORTED`."""
    if found not in SUPPORTED:
        raise RuntimeError(
            f"rematd.integrations.torchtitan supports torchtitan {', '.join(SUPPORTED)}; this is torchtitan "
            f"{found}: pip install torchtitan=={SUPPORTED[-1]}"
        )


try:
    import torchtitan
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"rematd.integrations.torchtitan needs torchtitan {SUPPORTED[-1]} (Python 3.11 or later): "
        "pip install 'rematd[torchtitan]'"
    ) from err

check_version(torchtitan.__version__)

# torchtitan's own modules only once the release is known to be one whose layout this module expects.
import torch  # noqa: E402
import tyro  # noqa: E402
from torch import nn  # noqa: E402
from torchtitan.config.manager import ConfigManager, custom_registry  # noqa: E402
from torchtitan.distributed.activation_checkpoint import (  # noqa: E402
    ActivationCheckpointing,
    ActivationCheckpointingConfig,
    SelectiveAC,
)
from torchtitan.observability import structured_logger  # noqa: E402
from torchtitan.tools import utils as titan_utils  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from rematd.client import attach  # noqa: E402
from rematd.client.arguments import (  # noqa: E402
    check_bytes,
    check_job,
    check_margin,
    check_server,
    parse_modes,
    pin_sequence,
)
from rematd.client.blocks.compress import check_compress  # noqa: E402
from rematd.client.blocks.offload import OffloadConfig  # noqa: E402
from rematd.integrations.torchtitan_parts import (  # noqa: E402
    FLAG,
    Attached,
    attach_options,
    find_layers,
    pin_layers,
)
from rematd.planner import Mode  # noqa: E402

log = logging.getLogger("rematd.torchtitan")


@dataclass(slots=True)
class _Building:
    """What :meth:`RematdCheckpointing.apply` leaves while :class:`RematdTrainer` builds its model parts."""

    attached: list[Attached]
    pipeline: bool
    """Whether the parts are pipeline stages: their blocks are attached through the schedule, once it exists."""
    stages: list[tuple[nn.Module, list[tuple[str, nn.Module]]]] = field(default_factory=list)
    """Each stage's module and its layers, for the schedule's handle."""


_BUILDING: contextvars.ContextVar[_Building | None] = contextvars.ContextVar("rematd_torchtitan", default=None)


class RematdCheckpointing(ActivationCheckpointing):  # type: ignore[misc]
    """rematd's policy: each block runs the mode its plan gives it (store, selective, recompute, ...), planned
    from the memory measured at every step and switched between steps."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):  # type: ignore[misc]
        # torchtitan's checkpoint wrapper's settings, which rematd has no use for: it restores the RNG state
        # whenever it recomputes (so training is bitwise that without checkpointing), and has no debug mode.
        preserve_rng_state: Annotated[bool, tyro.conf.Suppress] = True
        determinism_check: Annotated[str, tyro.conf.Suppress] = "default"
        debug: Annotated[bool, tyro.conf.Suppress] = False

        budget_bytes: int | None = None
        """Memory each rank may use, in bytes. On CUDA, device memory (default: the device's capacity); on the
        CPU, bytes saved for backward plus the rank's FSDP shards (parameters, gradients, optimizer state)."""

        margin: float = 0.1
        """Fraction of the budget the planner keeps free, in [0, 1)."""

        modes: list[str] = field(
            default_factory=lambda: ["store", "selective", "titan", "attention", "mlp", "recompute"]
        )
        """Modes a plan may give a block: store, selective (Megatron's), titan (torchtitan's selective policy),
        attention or mlp (that part of the block recomputed alone), recompute, offload (CUDA only), compress
        (lossy)."""

        pin: list[str] = field(default_factory=list)
        """Fix the modes instead of planning them: one mode for every block, or one per layer of the model
        (by layer number, so that every pipeline stage takes its own). Empty: the planner chooses."""

        server: str | None = None
        """A rematd service's host:port to plan on; empty: plan in each training process."""

        job: str | None = None
        """The job's name on the service (every rank passes the same); default: one made from the run."""

        compress: str | None = None
        """The compress mode's format (int8, fp8 or bf16); only with compress in modes."""

        offload_prefetch: int | None = None
        """Offloaded blocks fetched back ahead of the one whose backward starts (default 1); only with offload in
        modes."""

        compile: bool = False
        """Compile each block with Inductor, one graph per mode with the checkpoint inside it (in place of
        torchtitan's --compile.enable for the model)."""

        def __post_init__(self) -> None:
            checks: dict[str, Callable[[], object]] = {
                "budget-bytes": lambda: check_bytes("budget_bytes", self.budget_bytes),
                "margin": lambda: check_margin(self.margin),
                "modes": lambda: parse_modes(self.modes),
                "pin": lambda: self.pin and pin_sequence(self.pin, len(self.pin)),
                "server": lambda: check_server(self.server),
                "job": lambda: check_job(self.job),
                "compress": lambda: self.compress is not None and check_compress(self.compress),
                "offload-prefetch": lambda: (
                    self.offload_prefetch is not None and OffloadConfig(prefetch_blocks=self.offload_prefetch)
                ),
            }
            for flag, check in checks.items():
                try:
                    check()
                except (TypeError, ValueError) as err:
                    raise ValueError(f"{FLAG}.{flag}: {err}") from err
            offered = parse_modes(self.modes)
            if self.compress is not None and Mode.COMPRESS not in offered:
                raise ValueError(f"{FLAG}.compress configures the compress mode: add compress to {FLAG}.modes")
            if self.offload_prefetch is not None and Mode.OFFLOAD not in offered:
                raise ValueError(f"{FLAG}.offload-prefetch configures the offload mode: add offload to {FLAG}.modes")
            if Mode.COMPRESS in pin_sequence(self.pin, len(self.pin)) and Mode.COMPRESS not in offered:
                raise ValueError(f"{FLAG}.pin: compress is lossy and opt-in: add compress to {FLAG}.modes")

    def apply(self, model: nn.Module) -> None:
        """Attach rematd to ``model`` (one model part) where torchtitan would wrap its blocks; a pipeline stage's
        blocks are attached through the schedule, which plans the rank's stages together, once it exists."""
        building = _BUILDING.get()
        if building is None:
            raise RuntimeError(
                "activation-checkpoint:rematd needs rematd's trainer, which follows the optimizer and closes "
                "rematd with the run: start training with python -m rematd.integrations.torchtitan"
            )
        layers = find_layers(model)
        if building.pipeline:
            building.stages.append((model, layers))
            return
        if not layers:
            log.info("rematd: this model part holds no layers; nothing to checkpoint in it")
            return
        handle = attach(model, blocks=[block for _, block in layers], **attach_options(self.config))
        building.attached.append(Attached([model], handle))
        pin_layers(handle, self.config, [key for key, _ in layers])


CheckpointingChoice: TypeAlias = (
    ActivationCheckpointingConfig | Annotated[RematdCheckpointing.Config, tyro.conf.subcommand("rematd")]
)


def _captures_cuda_graphs(training: Any) -> bool:
    """Whether torchtitan will capture the forward and backward in a CUDA graph (it does on NVIDIA GPUs)."""
    return (
        not training.disable_cuda_graphs
        and titan_utils.device_type == "cuda"
        and torch.cuda.is_available()
        and torch.version.hip is None
    )


class RematdTrainer(Trainer):  # type: ignore[misc]
    """torchtitan's trainer with ``activation-checkpoint:rematd`` among its checkpointing modes."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):  # type: ignore[misc]
        activation_checkpoint: CheckpointingChoice = field(default_factory=SelectiveAC.Config)
        """How blocks keep activations for backward: torchtitan's own modes, or rematd's plan."""

        def __post_init__(self) -> None:
            Trainer.Config.__post_init__(self)
            if not isinstance(self.activation_checkpoint, RematdCheckpointing.Config):
                return
            if self.compile.enable and "model" in self.compile.components:
                raise ValueError(
                    "activation-checkpoint:rematd switches each block's mode between steps, which a block compiled "
                    "by torchtitan bakes in: leave 'model' out of --compile.components (keep 'loss') and set "
                    f"{FLAG}.compile, which compiles each block with rematd's modes inside"
                )
            if _captures_cuda_graphs(self.training):
                raise ValueError(
                    "activation-checkpoint:rematd changes the blocks' modes between steps, which a captured CUDA "
                    "graph would replay unchanged: pass --training.disable-cuda-graphs"
                )

    def __init__(self, config: Config) -> None:
        self.rematd: list[Attached] = []
        """Every handle rematd attached (none unless the mode is rematd): one per model part, or under pipeline
        parallel one for the rank's stages."""
        building = _Building(self.rematd, pipeline=config.parallelism.pipeline_parallel_degree > 1)
        token = _BUILDING.set(building)
        try:
            super().__init__(config)
            if building.stages:
                self._attach_schedule(building.stages, config.activation_checkpoint)
            self._follow_optimizers()
        except BaseException:
            self._close_handles()
            raise
        finally:
            _BUILDING.reset(token)

    def _attach_schedule(
        self, stages: list[tuple[nn.Module, list[tuple[str, nn.Module]]]], c: RematdCheckpointing.Config
    ) -> None:
        """One handle for the rank's pipeline stages, following torchtitan's schedule: its ``step()`` starts a
        step, and each stage's plan counts the microbatches the schedule keeps alive on it."""
        layers = sorted(((key, block) for _, part in stages for key, block in part), key=lambda kb: int(kb[0]))
        handle = attach(self.pp_schedule, blocks=[block for _, block in layers], **attach_options(c))
        self.rematd.append(Attached([module for module, _ in stages], handle))
        pin_layers(handle, c, [key for key, _ in layers])

    def _follow_optimizers(self) -> None:
        """End each handle's step after the step of the last optimizer that owns its parts' parameters."""
        optimizers = list(getattr(self.optimizers, "optimizers", [self.optimizers]))
        for attached in self.rematd:
            owned = {id(p) for part in attached.parts for p in part.parameters()}
            own = [o for o in optimizers if any(id(p) in owned for g in o.param_groups for p in g["params"])]
            attached.handle.optimizer = own[-1] if own else None

    def train_step(self, data_iterator: Iterator[Any]) -> None:
        super().train_step(data_iterator)
        for attached in self.rematd:
            attached.handle.step()  # parts no optimizer owns; after their optimizer's step this does nothing
        self._log_plans()

    def _log_plans(self) -> None:
        """On the first rank, a line for each plan's first step: its modes, predicted and measured peaks."""
        if not self.rematd or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
            return
        for i, attached in enumerate(self.rematd):
            plan, stats = attached.handle.plan, attached.handle.last_stats
            if stats is None or plan.version == attached.logged:
                continue
            attached.logged = plan.version
            log.info(
                "rematd%s: plan %d ran %s: peak %.1f MiB (predicted %.1f MiB), budget %.1f MiB; %s",
                f" (model part {i})" if len(self.rematd) > 1 else "",
                plan.version,
                "".join(m.letter for m in attached.handle.modes),
                (stats.saved_peak_bytes or stats.peak_allocated_bytes) / 2**20,
                plan.predicted_peak_bytes / 2**20,
                stats.budget_bytes / 2**20,
                plan.reason,
            )

    def _close_handles(self) -> None:
        for attached in self.rematd:
            attached.handle.close()

    def close(self) -> None:
        self._close_handles()
        super().close()


def rematd_config(loaded: Any) -> RematdTrainer.Config:
    """The config torchtitan's registry made (a ``Trainer.Config``), as :class:`RematdTrainer`'s."""
    if type(loaded) is not Trainer.Config:
        raise ValueError(
            f"--config made a {type(loaded).__qualname__}; rematd's mode extends torchtitan's Trainer.Config only "
            "(the configs of the models under torchtitan.models)"
        )
    values = {f.name: getattr(loaded, f.name) for f in dataclasses.fields(loaded) if f.init}
    return RematdTrainer.Config(**values)


class RematdConfigManager(ConfigManager):  # type: ignore[misc]
    """torchtitan's ``--module`` / ``--config`` / flags parsing, into :class:`RematdTrainer`'s config."""

    def parse_args(self, args: list[str] | None = None) -> RematdTrainer.Config:
        args = sys.argv[1:] if args is None else args
        loaded, rest = self._load_config(args)
        self.config = tyro.cli(RematdTrainer.Config, args=rest, default=rematd_config(loaded), registry=custom_registry)
        self._validate_config()
        return self.config  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m rematd.integrations.torchtitan``: torchtitan's ``train`` with rematd's trainer."""
    init_logger()
    config = RematdConfigManager().parse_args(None if argv is None else list(argv))
    structured_logger.init_structured_logger(
        source="training", output_dir=config.dump_folder, enable=config.debug.enable_structured_logging
    )
    trainer: RematdTrainer | None = None
    try:
        trainer = config.build()
        assert trainer is not None
        if config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    except Exception:
        if trainer is not None:
            trainer.close()
        raise
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
