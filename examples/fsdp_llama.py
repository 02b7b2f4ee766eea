"""A stock Llama trained with FSDP2 under a byte budget, rematd choosing what each block recomputes.

    .venv/bin/torchrun --nproc-per-node 2 examples/fsdp_llama.py                 # CPU, gloo
    .venv/bin/torchrun --nproc-per-node 8 examples/fsdp_llama.py --budget-gib 40  # GPUs, nccl

torchtitan's order: rematd attaches to the unsharded model (checkpointing each block), then each block and
the model are sharded with ``fully_shard``, then the optimizer is made over the sharded parameters and
handed to the handle. The sequence length grows and shrinks over the run; each rank prints its plan per
step in rematd's letters (``.`` store, ``R`` recompute; the README's
table of modes has the rest), the same on every rank, and each new plan's reason.

On the CPU the budget covers what a device would hold: the rank's shards (parameters, gradients, optimizer
state), the parameters FSDP gathers, and the activations saved for backward.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from rematd import client
from rematd.planner import letters


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24, help="training steps (default 24)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step (default 4)")
    p.add_argument("--seq", type=int, nargs="+", default=[128, 512, 128], help="lengths, a phase each")
    p.add_argument("--budget-gib", type=float, default=None, help="memory budget per rank, GiB")
    p.add_argument("--budget-mib", type=float, default=160.0, help="memory budget per rank, MiB (default 160)")
    p.add_argument("--server", default=None, help="a rematd service host:port (default: plan in-process)")
    return p.parse_args()


def llama(layers: int, hidden: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=4096,
        attention_dropout=0.0,
    )
    return LlamaForCausalLM(config)


_SAID: dict[int, int] = {}
"""The plan version whose reason each rank printed last."""


def say(h: client.Handle, rank: int, step: int, seq: int, budget: int, loss: torch.Tensor) -> None:
    """One line per step: the plan the rank ran, its peak against the budget; and a plan's reason when a
    new plan comes into force."""
    memory = h.last_memory  # on CUDA the allocator's peak; on the CPU the accounting's
    peak = (memory.peak_allocated_bytes or memory.saved_peak_bytes) if memory is not None else 0
    plan = h.plan  # the plan this step ran; the ranks that run one plan show one version
    said = ""
    if _SAID.get(rank) != plan.version:
        _SAID[rank] = plan.version
        said = f"rank {rank} plan v{plan.version}: {plan.reason}\n"
    # One write: the ranks share the terminal, and a write to it of up to 4 KiB lands whole.
    sys.stdout.write(
        f"{said}rank {rank} step {step:3d} seq {seq:5d} plan {letters(h.modes)} v{plan.version} "
        f"peak {peak / 2**20:8.1f} MiB budget {budget / 2**20:8.1f} MiB loss {loss.item():.3f}\n"
    )
    sys.stdout.flush()


def main() -> None:
    args = parse()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(0)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    with device:
        model = llama(args.layers, args.hidden)
    budget = int(args.budget_gib * 2**30) if args.budget_gib else int(args.budget_mib * 2**20)
    h = client.attach(model, budget_bytes=budget, server=args.server, job="fsdp-llama-example")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    h.optimizer = opt  # made over the sharded parameters, after attach: h.step() follows its step()
    phase = max(1, args.steps // len(args.seq))
    data = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own batches
    for step in range(args.steps):
        seq = args.seq[min(step // phase, len(args.seq) - 1)]
        ids = torch.randint(0, 4096, (args.batch, seq), device=device, generator=data)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        say(h, rank, step, seq, budget, loss)
    h.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
