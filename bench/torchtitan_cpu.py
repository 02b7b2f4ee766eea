"""torchtitan on CPU ranks: the stand-ins it needs there, and a launcher that records what a run did.

torchtitan targets NVIDIA GPUs and a torch nightly. On the CPU build of a released torch it lacks:

- Triton (imported by its MoE expert-parallel kernels, which a dense model never runs): those kernels'
  module is a stub whose functions raise;
- a device: it picks ``cuda`` when no accelerator is found; the CPU stands in, with the few calls torchtitan
  makes of a device module (no memory statistics);
- FlexAttention's backward (none on the CPU): the same attention, with the block mask made dense, through
  ``scaled_dot_product_attention``; the block mask is made eagerly instead of compiled;
- gloo's ``PREMUL_SUM`` (FSDP divides gradients with it when a divide factor is set, as torchtitan sets
  one): FSDP reduces with SUM and divides itself, as it does on MTIA;
- ``torch.distributed.set_timeout`` (a torch nightly's): a no-op;
- with ``REMATD_TITAN_FLOAT_EXPERTS=1``, bfloat16 expert matmuls: the experts' grouped matmul casts the weights
  and tokens to bfloat16, which CPUs without bfloat16 instructions run several times slower than float32 (a step
  of ``qwen3_moe_debug``'s 64 experts took 17 s on 2 ranks, 5 s without the casts); with it the experts run in
  their parameters' dtype (the tests' runs, compared with each other; what the casts keep is in
  docs/torchtitan.md);
- the 2 s rank 0 sleeps after the last step, for other ranks' devices to finish: left out;
- pipeline schedules that take micro-batches (a nightly's ``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``):
  they go to the schedule's ``_step_microbatches``, which a release has.

``python -m bench.torchtitan_cpu MODULE ARGS...`` (under ``torchrun -m``, from the repository's root; as a script,
``bench/`` would shadow the torchtitan and deepspeed packages) installs them and runs ``python -m MODULE
ARGS...``: ``torchtitan.train`` or ``rematd.integrations.torchtitan``, with torchtitan's own arguments. With
``REMATD_TITAN_RECORD=dir`` each rank writes ``dir/rank<N>.pt``: every step's loss, rematd's statistics per
step (when attached), each step's seconds and the parameters at the end, gathered whole (with
``REMATD_TITAN_DIGESTS=1`` only a digest of each rank's own part of each, :func:`digest`: a mixture of experts'
whole parameters are gigabytes a rank, which a comparison of runs alike sharded need not gather, write and read
back); with ``REMATD_TITAN_PROFILE_STEP=k`` also step k's peak of CPU memory above its start, from torch's memory
profiler (that step is slowed by it); with ``REMATD_TITAN_PRICE=RRRR..,...`` also what those plans (a letter a
block) would recompute, as each step's planner prices them, beside what the modes run do; with
``REMATD_TITAN_SKEW=k,l,...`` the routers of a mixture of experts send every token to the same experts (the first
``top_k``, all on the first expert-parallel rank) on those steps (counted
from 1), as a batch all of one kind of token would. With ``REMATD_TITAN_QWEN3_EXPERTS=N,K`` qwen3's
mixtures of experts are built with N experts a block, K chosen a token (the tests' smaller runs).

:func:`make_assets` writes a tokenizer and a small text data set (nothing is downloaded).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import random
import runpy
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

from bench.common import profiled_peak
from rematd.planner import MODES_BY_LETTER, Mode

RECORD = "REMATD_TITAN_RECORD"
PROFILE_STEP = "REMATD_TITAN_PROFILE_STEP"
SKEW = "REMATD_TITAN_SKEW"
DIGESTS = "REMATD_TITAN_DIGESTS"
FLOAT_EXPERTS = "REMATD_TITAN_FLOAT_EXPERTS"
QWEN3_EXPERTS = "REMATD_TITAN_QWEN3_EXPERTS"
PRICE = "REMATD_TITAN_PRICE"


def make_assets(where: Path, *, documents: int = 200, seed: int = 0) -> tuple[Path, Path]:
    """A word-level tokenizer (with torchtitan's BOS and EOS) and a JSON-lines data set of random words; the
    tokenizer's folder and the data set's folder (``--hf-assets-path``, ``--dataloader.dataset-path``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(seed)
    words = [f"w{i}" for i in range(500)]
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir, data_dir = where / "tokenizer", where / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(special))
    lines = (
        json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 200)))}) for _ in range(documents)
    )
    (data_dir / "train.json").write_text("\n".join(lines) + "\n")
    return tok_dir, data_dir


# -- stand-ins ---------------------------------------------------------------


def stub_triton_kernels() -> None:
    try:
        import triton  # noqa: F401

        return
    except ImportError:
        pass
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    module = types.ModuleType(name)

    def missing(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def fail(*_: Any, **__: Any) -> Any:
            raise RuntimeError(f"{attr} is a Triton kernel; Triton is not installed")

        return fail

    module.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules[name] = module


class _CpuDevice(types.ModuleType):
    """The device module torchtitan asks for, on the CPU: one device, no memory statistics."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass


def _dense_flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    score_mod: Any,
    block_mask: Any,
    scale: float | None,
    enable_gqa: bool,
    return_aux: Any,
    kernel_options: Any,
) -> tuple[torch.Tensor, None]:
    """FlexAttention without its kernel: the mask made dense, the attention by SDPA (it has a CPU backward)."""
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None or return_aux.lse:
        raise NotImplementedError("the CPU stand-in for FlexAttention takes a mask only")
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, None


def _experts_in_their_dtype(self: Any, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``GroupedExperts.forward`` without the casts to bfloat16: SwiGLU over each expert's rows."""
    from torch.distributed.tensor import DTensor

    w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)

    def grouped(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, w.to(a.dtype).transpose(-2, -1), offs=offsets)

    hidden = torch.nn.functional.silu(grouped(x, w1)) * grouped(x, w3)
    return grouped(hidden, w2).type_as(x)


def _sum_reduction_on_gloo() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    original = collectives._get_gradient_divide_factors
    signature = inspect.signature(original)

    @functools.wraps(original)
    def factors(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["force_sum_reduction_for_comms"] = True
        return original(*bound.args, **bound.kwargs)

    collectives._get_gradient_divide_factors = factors


def _pipeline_steps_take_microbatches() -> None:
    """A released torch's schedules split a whole batch in ``step``; torchtitan hands them the micro-batches
    (``arg_mbs=``, ``kwarg_mbs=``, ``target_mbs=``), as a nightly's do: those go to ``_step_microbatches``."""
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        whole_batch = cls.step
        if "arg_mbs" in inspect.signature(whole_batch).parameters:
            continue

        def step(self: Any, *args: Any, whole_batch: Any = whole_batch, **kwargs: Any) -> Any:
            if not {"arg_mbs", "kwarg_mbs", "target_mbs"} & kwargs.keys():
                return whole_batch(self, *args, **kwargs)
            stages = getattr(self, "_stages", None) or [self._stage]
            for stage in stages:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(
                kwargs.get("arg_mbs"),
                kwargs.get("kwarg_mbs"),
                kwargs.get("target_mbs"),
                kwargs.get("losses"),
                kwargs.get("return_outputs", True),
                loss_kwargs=kwargs.get("loss_kwargs"),
            )
            return None

        cls.step = step


def install() -> None:
    """Every stand-in, before torchtitan's modules that read the device are imported."""
    import torch.distributed as dist

    stub_triton_kernels()
    from torchtitan.tools import utils

    utils.device_type, utils.device_module = "cpu", _CpuDevice("cpu_device")
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: None
    _sum_reduction_on_gloo()
    _pipeline_steps_take_microbatches()
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    attention.FlexAttention._compiled_flex_attn = staticmethod(_dense_flex_attention)
    attention._compiled_create_block_mask = create_block_mask
    if os.environ.get(FLOAT_EXPERTS) == "1":
        from torchtitan.models.common import moe

        moe.GroupedExperts.forward = _experts_in_their_dtype
    if os.environ.get(QWEN3_EXPERTS):
        _qwen3_experts(os.environ[QWEN3_EXPERTS])
    _no_sleep_at_the_end()


def _no_sleep_at_the_end() -> None:
    """torchtitan's rank 0 sleeps 2 s after its last step "for other ranks to complete" (their devices' queued
    work); CPU ranks have run theirs by the step's last collective, and a launch that leaves it out is 2 s
    shorter (the tests launch dozens)."""
    from torchtitan import trainer

    trainer.time = types.SimpleNamespace(**{**vars(time), "sleep": lambda seconds: None})  # type: ignore[assignment]


def _qwen3_experts(spec: str) -> None:
    """qwen3's mixtures of experts built with ``N,K``: N experts a layer, the router choosing K of them."""
    try:
        experts, top_k = (int(n) for n in spec.split(","))
    except ValueError:
        raise SystemExit(f"{QWEN3_EXPERTS}={spec!r}: expected two integers, experts and top_k (say 16,4)") from None
    if not 0 < top_k <= experts:
        raise SystemExit(f"{QWEN3_EXPERTS}={spec!r}: top_k must be between 1 and the number of experts")
    from torchtitan.models import qwen3

    build = qwen3._build_qwen3_moe_layers

    def fewer(**kwargs: Any) -> Any:
        return build(**{**kwargs, "num_experts": experts, "top_k": top_k})

    qwen3._build_qwen3_moe_layers = fewer


# -- recording ---------------------------------------------------------------


def _record(where: Path) -> None:
    """Wrap torchtitan's trainer so that each rank saves its losses, rematd's statistics and its parameters."""
    from torchtitan.trainer import Trainer

    losses: list[torch.Tensor] = []
    steps: list[list[dict[str, Any]]] = []
    seconds: list[float] = []
    peaks: list[int] = []
    profile_step = int(os.environ.get(PROFILE_STEP, "0"))
    forward_backward, train_step, close = Trainer.forward_backward_step, Trainer.train_step, Trainer.close

    def recorded_forward_backward(self: Any, **kwargs: Any) -> torch.Tensor:
        loss = forward_backward(self, **kwargs)
        losses.append(_whole(loss))  # a distributed tensor under tensor parallel's loss parallelism
        return loss  # type: ignore[no-any-return]

    def recorded_train_step(self: Any, data_iterator: Any) -> None:
        profiled = len(seconds) + 1 == profile_step
        timed_step(lambda: train_step(self, data_iterator), profiled=profiled, seconds=seconds, peaks=peaks)
        steps.append([_stats(part.handle) for part in getattr(self, "rematd", [])])

    def recorded_close(self: Any) -> None:
        keep = digest if os.environ.get(DIGESTS) == "1" else _whole
        params = {name: keep(p) for m in self.model_parts for name, p in m.named_parameters()}
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        record = {"losses": losses, "steps": steps, "params": params, "seconds": seconds, "peaks": peaks}
        torch.save(record, where / f"rank{rank}.pt")
        close(self)

    Trainer.forward_backward_step = recorded_forward_backward
    Trainer.train_step = recorded_train_step
    Trainer.close = recorded_close


def timed_step(step: Any, *, profiled: bool, seconds: list[float], peaks: list[int]) -> None:
    """Run a training step, its seconds appended to ``seconds``; ``profiled``, under torch's memory profiler (which
    slows it), its peak appended to ``peaks`` where the profiler can read the step."""
    started = time.perf_counter()
    if profiled:
        try:
            peaks.append(profiled_peak(step))
        except AssertionError as e:
            # The profiler reads its trace after the step has run: under FSDP on gloo ranks its data-flow
            # analysis can fail on the collectives' buffers ("version mismatch"). The step stands; its peak is
            # unknown.
            print(f"torch's memory profiler could not read the step: {str(e)[:120]}", file=sys.stderr)
    else:
        step()
    seconds.append(time.perf_counter() - started)


def _whole(p: torch.Tensor) -> torch.Tensor:
    full = getattr(p, "full_tensor", None)
    return (full() if callable(full) else p).detach().clone()


def digest(p: torch.Tensor) -> str:
    """This rank's part of a parameter (all of it unless sharded), as its placement, dtype, shape and a hash of its
    bytes. Two runs sharded alike have bitwise the same parameters when every rank's digests are equal: every
    element is some rank's."""
    to_local = getattr(p, "to_local", None)
    t = (to_local() if callable(to_local) else p).detach().contiguous()
    placements = getattr(p, "placements", ())
    data = hashlib.blake2b(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()
    return f"{placements} {t.dtype} {tuple(t.shape)} {data}"


def _stats(handle: Any) -> dict[str, Any]:
    """What the step that just ended ran and measured, and the plan in force for it."""
    stats = handle.last_stats
    ran = next((p for p in handle.history if p.version == stats.plan_version), None)
    # Every block stored, as the rank's planner prices it (the profiling step recomputes them all).
    storing = handle._applier.price(tuple(Mode.STORE for _ in handle.modes), stats.plan_version, "", None)
    # What the modes run recompute, as the rank's planner prices them from its profile: a fraction of a forward.
    running = handle._applier.price(tuple(stats.modes), stats.plan_version, "", None) if stats.modes else None
    priced = {}
    for plan in filter(None, os.environ.get(PRICE, "").split(",")):
        other = handle._applier.price(tuple(MODES_BY_LETTER[c] for c in plan), stats.plan_version, "", None)
        priced[plan] = other.predicted_overhead_ratio if other is not None else 0.0
    return {
        "storing": storing.predicted_peak_bytes if storing is not None else 0,
        "step": stats.step,
        "plan_version": stats.plan_version,
        "modes": [m.label for m in handle.modes],
        "measured": stats.saved_peak_bytes or stats.peak_allocated_bytes,
        "predicted": ran.predicted_peak_bytes if ran is not None else 0,
        "in_force": handle.plan.predicted_peak_bytes,
        "budget": stats.budget_bytes,
        "static": stats.static_bytes,
        "reason": ran.reason if ran is not None else "",
        "ran": "".join(m.letter for m in stats.modes),
        "ran_reason": handle.plan.reason,
        "routed": stats.routed_bytes,
        "overhead": running.predicted_overhead_ratio if running is not None else 0.0,
        "priced": priced,
    }


def _skew(steps: set[int]) -> None:
    """On training steps ``steps`` (from 1), every router gate's scores favour its first ``top_k`` experts by a
    margin no token's own scores overturn."""
    from torchtitan.trainer import Trainer

    train_step = Trainer.train_step
    now = [0]

    def skewed(_m: torch.nn.Module, _args: Any, scores: torch.Tensor, top_k: int) -> torch.Tensor | None:
        if now[0] not in steps:
            return None
        favoured = torch.zeros(scores.shape[-1], dtype=scores.dtype, device=scores.device)
        favoured[:top_k] = 50.0
        return scores + favoured

    def counted_train_step(self: Any, data_iterator: Any) -> None:
        if not now[0]:
            for part in self.model_parts:
                for name, m in part.named_modules():
                    if name.endswith("router") and hasattr(m, "gate"):
                        m.gate.register_forward_hook(functools.partial(skewed, top_k=int(m.top_k)))
        now[0] += 1
        train_step(self, data_iterator)

    Trainer.train_step = counted_train_step


def main() -> None:
    install()
    if os.environ.get(SKEW):
        _skew({int(k) for k in os.environ[SKEW].split(",") if k})
    if os.environ.get(RECORD):
        _record(Path(os.environ[RECORD]))
    module, *args = sys.argv[1:]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
