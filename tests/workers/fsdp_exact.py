"""One rank of the FSDP2 exactness test: the same model trained with plain FSDP2 and with rematd, side by side.

For each case of ``REMATD_CONFIG`` (model, order of attach and fully_shard, reshard_after_forward,
mixed precision, autocast, compile), both copies take the same steps with dropout on while rematd's
modes are pinned through store, selective, recompute and a mix. Written per step: whether the losses,
the full gradients and the full parameters are bitwise equal, the collectives each copy issued, and
which blocks ran again in backward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import transformers
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from bench.collectives import counting
from rematd import client
from rematd.planner import Mode
from tests.model_matrix import Rematerialised
from tests.workers.rank import finish, settings, start

VOCAB = 64


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        cfg: Any = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_dropout=0.1,
            max_position_embeddings=64,
            use_cache=False,
        )
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4, n_head=4, use_cache=False
    )  # dropout 0.1 everywhere by default
    return transformers.GPT2LMHeadModel(cfg)


def layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None) or model.transformer
    return list(inner.layers if hasattr(inner, "layers") else inner.h)


def shard(model: nn.Module, case: dict[str, Any]) -> None:
    reshard: bool | int = case.get("reshard", True)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if case.get("mixed_precision")
        else MixedPrecisionPolicy()
    )
    for layer in layers(model):
        fully_shard(layer, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def schedule(n: int) -> list[list[Mode] | None]:
    mixed = [(Mode.SELECTIVE, Mode.RECOMPUTE, Mode.STORE)[i % 3] for i in range(n)]
    return [None, [Mode.SELECTIVE] * n, [Mode.RECOMPUTE] * n, mixed, [Mode.STORE] * n, [Mode.RECOMPUTE] * n]


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def all_equal(pairs: Iterable[tuple[torch.Tensor | None, torch.Tensor | None]]) -> bool:
    """Whether each pair of (possibly sharded) tensors is bitwise equal in full. Every pair is gathered before
    any is compared: a rank that stopped gathering at its first difference would issue fewer collectives than
    its peers, and the job would fail on the mismatch instead of reporting it."""
    gathered = [(full(a), full(b)) for a, b in pairs]
    return all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b)) for a, b in gathered
    )


def run_case(case: dict[str, Any], rank: int) -> dict[str, Any]:
    ref, model = build(case["model"]), build(case["model"])
    shard(ref, case)
    compile_backend = case.get("compile") or False
    if case["order"] == "before":
        h = client.attach(model, compile=compile_backend)
        shard(model, case)
    else:
        shard(model, case)
        h = client.attach(model, compile=compile_backend)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    h.optimizer = opt  # made after sharding: the handle follows it from here
    names = dict(model.named_modules())
    counter = Rematerialised([names[n] for n in h.blocks])
    autocast: AbstractContextManager[Any] = (
        torch.autocast("cpu", dtype=torch.bfloat16) if case.get("autocast") else nullcontext()
    )
    steps: list[dict[str, Any]] = []
    for step, pinned in enumerate(schedule(len(h.blocks))):
        if pinned is not None:
            h.pin_modes(pinned)
        gen = torch.Generator().manual_seed(1000 * rank + step)
        ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
        losses, comms = [], []
        for m in (ref, model):
            torch.manual_seed(100 + 10 * rank + step)  # dropout draws the same numbers in both
            # Counting runs the compiled graphs' ops eagerly, one by one: a compiled case is not counted.
            with counting() if not compile_backend else nullcontext(Counter()) as counts:
                with autocast:
                    loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
            comms.append(dict(counts))
            losses.append(loss.detach())
        grads = [(full(p.grad), full(q.grad)) for p, q in zip(ref.parameters(), model.parameters(), strict=True)]
        grads_equal = all((a is None and b is None) or torch.equal(a, b) for a, b in grads)  # type: ignore[arg-type]
        grad_diff = max(float((a - b).abs().max()) for a, b in grads if a is not None and b is not None)
        opt_ref.step()
        opt.step()  # runs h.step() through the hook the handle put on it
        opt_ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        params = [(full(p), full(q)) for p, q in zip(ref.parameters(), model.parameters(), strict=True)]
        params_equal = all(torch.equal(a, b) for a, b in params)  # type: ignore[arg-type]
        param_diff = max(float((a - b).abs().max()) for a, b in params)  # type: ignore[operator]
        steps.append(
            {
                "pinned": [m.name for m in pinned] if pinned else None,
                "modes": [m.name for m in h.modes],
                "loss_equal": bool(torch.equal(losses[0], losses[1])),
                "loss": float(losses[0].float()),
                "grads_equal": grads_equal,
                "params_equal": params_equal,
                "max_diff": max(grad_diff, param_diff, float((losses[0] - losses[1]).abs())),
                "plain_comms": comms[0],
                "rematd_comms": comms[1],
                "rerun": counter.take(),
            }
        )
    stats = h.compile_stats
    result = {
        "case": case,
        "steps": steps,
        "step_count": h.step_count,
        "blocks": h.blocks,
        "graphs": stats.graphs if stats is not None else 0,
    }
    counter.remove()
    h.close()
    return result


def main() -> None:
    rank = start()
    cases = settings()
    results = [run_case(case, rank) for case in cases]
    finish(results)


if __name__ == "__main__":
    main()
