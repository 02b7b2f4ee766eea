"""A stock Llama trained pipeline-parallel, one stage a rank, rematd planning each stage for its own memory.

    .venv/bin/torchrun --nproc-per-node 2 examples/pipeline_llama.py                     # CPU, gloo
    .venv/bin/torchrun --nproc-per-node 4 examples/pipeline_llama.py --budget-gib 40     # GPUs, nccl

The model is split torchtitan's way: every rank builds the whole model, keeps its stage's layers (a
``ModuleDict`` by layer id, the others deleted) and drops the embedding or the head it does not hold. The
stages run ``Schedule1F1B``: the first stage holds the activations of as many microbatches as there are stages,
the last one of one, so at one budget the first stages recompute and the last ones need not. Each rank prints
its stage's plan per step (``.`` store, ``s`` selective, ``R`` recompute) and its peak against the budget, and
each new plan's reason.

On the CPU the budget caps the bytes saved for backward.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from rematd import client
from rematd.planner import letters


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16, help="training steps (default 16)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers, split evenly over the stages (default 8)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--seq", type=int, default=256, help="sequence length (default 256)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches a step (default 4)")
    p.add_argument("--microbatch", type=int, default=2, help="sequences a microbatch (default 2)")
    p.add_argument("--budget-gib", type=float, default=None, help="memory budget per rank, GiB")
    p.add_argument("--budget-mib", type=float, default=80.0, help="memory budget per rank, MiB (default 80)")
    p.add_argument("--server", default=None, help="a rematd service host:port (default: plan in-process)")
    return p.parse_args()


class LlamaStage(nn.Module):
    """One stage of a stock ``LlamaForCausalLM``, laid out as torchtitan lays out its models."""

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        super().__init__()
        model = copy.deepcopy(model)
        inner = model.model
        per = len(inner.layers) // stages
        keep = range(stage * per, len(inner.layers) if stage == stages - 1 else (stage + 1) * per)
        self.tok_embeddings = inner.embed_tokens if stage == 0 else None
        self.layers = nn.ModuleDict({str(i): inner.layers[i] for i in keep})
        self.norm = inner.norm if stage == stages - 1 else None
        self.output = model.lm_head if stage == stages - 1 else None
        self.rotary = inner.rotary_emb

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        rotary = self.rotary(h, torch.arange(h.shape[1], device=h.device).unsqueeze(0))
        for layer in self.layers.values():
            h = layer(h, position_embeddings=rotary)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def llama(layers: int, hidden: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # every rank builds the same model and keeps its own stage
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=4096,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def main() -> None:
    args = parse()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, stages = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    module = LlamaStage(llama(args.layers, args.hidden), rank, stages).to(device)
    schedule = Schedule1F1B(PipelineStage(module, rank, stages, device), args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    budget = int(args.budget_gib * 2**30) if args.budget_gib else int(args.budget_mib * 2**20)
    # Attached to the schedule: its step() starts rematd's step, and the stage's plan counts the microbatches
    # the schedule keeps alive at once on it. Every rank of the job passes the same job=.
    h = client.attach(schedule, optimizer=opt, budget_bytes=budget, job="llama-pipeline", server=args.server)
    gen = torch.Generator().manual_seed(0)
    said = -1  # the plan version whose reason was printed last
    for step in range(args.steps):
        batch = torch.randint(0, 4096, (args.microbatches * args.microbatch, args.seq), generator=gen).to(device)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(batch)
        elif rank == stages - 1:
            schedule.step(target=batch, losses=losses)
        else:
            schedule.step()
        opt.step()  # h.step() runs after it by itself
        opt.zero_grad(set_to_none=True)
        memory = h.last_memory
        peak = (memory.peak_allocated_bytes or memory.saved_peak_bytes) if memory is not None else 0
        loss = f" loss {torch.stack(losses).mean().item():.3f}" if losses else ""
        plan = h.plan  # the plan this step ran
        reason = f"stage {rank} plan v{plan.version}: {plan.reason}\n" if plan.version != said else ""
        said = plan.version
        # One write: the ranks share the terminal, and a write to it of up to 4 KiB lands whole.
        sys.stdout.write(
            f"{reason}stage {rank} step {step:3d} plan {letters(h.modes)} v{plan.version} "
            f"peak {peak / 2**20:7.1f} MiB budget {budget / 2**20:7.1f} MiB{loss}\n"
        )
        sys.stdout.flush()
    h.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
