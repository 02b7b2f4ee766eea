"""One CUDA rank (world size 1): FSDP2 with rematd, a budget between storing and recomputing every block at a
long length, trained at a short length first. The first step at the long length must fit on the first try."""

from __future__ import annotations

import torch

from rematd import client
from rematd.planner import Mode
from tests.workers.fsdp_exact import shard
from tests.workers.rank import finish, start


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=683, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, use_cache=False,
    )  # fmt: skip
    with torch.device("cuda"):
        return LlamaForCausalLM(cfg)


def steps(model: torch.nn.Module, h: client.Handle, opt: torch.optim.Optimizer, seq: int, n: int) -> list[int]:
    peaks = []
    for _ in range(n):
        ids = torch.randint(0, 4096, (8, seq), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert h.last_memory is not None
        peaks.append(h.last_memory.peak_allocated_bytes)
    return peaks


def main() -> None:
    start("nccl")
    torch.cuda.set_device(0)
    long, short = 1024, 128
    probe = llama()
    h = client.attach(probe)
    shard(probe, {})
    opt: torch.optim.Optimizer = torch.optim.AdamW(probe.parameters())
    h.optimizer = opt
    measured = {}
    for mode in (Mode.STORE, Mode.RECOMPUTE):
        h.pin_modes([mode] * len(h.blocks))
        measured[mode.name] = max(steps(probe, h, opt, long, 3)[1:])
    h.close()
    del probe, opt, h
    torch.cuda.empty_cache()

    budget = (measured["STORE"] + measured["RECOMPUTE"]) // 2
    model = llama()
    h = client.attach(model, budget_bytes=budget)
    shard(model, {})
    opt = torch.optim.AdamW(model.parameters())
    h.optimizer = opt
    before = steps(model, h, opt, short, 6)
    first_long = steps(model, h, opt, long, 1)[0]
    result = {
        "budget": budget,
        "measured": measured,
        "short": before,
        "first_long": first_long,
        "modes": [m.name for m in h.modes],
    }
    h.close()
    finish(result)


if __name__ == "__main__":
    main()
