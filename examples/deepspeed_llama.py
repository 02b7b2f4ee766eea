"""A stock Llama trained with DeepSpeed ZeRO-3 under a byte budget, rematd choosing what each block recomputes.

    DS_ACCELERATOR=cpu .venv/bin/torchrun --nproc-per-node 2 examples/deepspeed_llama.py                # CPU, gloo
    .venv/bin/deepspeed --num_gpus 8 examples/deepspeed_llama.py --budget-gib 40 --bf16                  # GPUs

rematd attaches to the engine ``deepspeed.initialize`` returns; its step follows ``engine.step()`` at each
gradient accumulation boundary. The sequence length grows and shrinks over the run; each rank prints its plan
per step in rematd's letters (``.`` store, ``R`` recompute; the README's
table of modes has the rest), the same on every rank, and each new plan's reason.

On the CPU the budget covers what a device would hold: the rank's ZeRO-3 partitions (parameters, gradients,
fp32 master weights, optimizer state), the parameters ZeRO-3 holds gathered, and the activations saved for
backward.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from typing import NoReturn

import deepspeed
import torch
from fsdp_llama import llama, say  # beside this file: the same model and per-step line as the FSDP example

from rematd import client

# DeepSpeed gathers and scatters through torch.distributed functions this torch calls deprecated; every call
# would print a FutureWarning that says nothing about the training.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24, help="optimizer steps (default 24)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and micro-batch (default 4)")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step (default 2)")
    p.add_argument("--seq", type=int, nargs="+", default=[128, 512, 128], help="lengths, a phase each")
    p.add_argument("--budget-gib", type=float, default=None, help="memory budget per rank, GiB")
    p.add_argument("--budget-mib", type=float, default=160.0, help="memory budget per rank, MiB (default 160)")
    p.add_argument("--bf16", action="store_true", help="bf16 through DeepSpeed's config")
    p.add_argument("--server", default=None, help="a rematd service host:port (default: plan in-process)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args()


def config(args: argparse.Namespace) -> dict[str, object]:
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.accumulation,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": args.bf16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def main() -> None:
    args = parse()
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = llama(args.layers, args.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config(args))
    budget = int(args.budget_gib * 2**30) if args.budget_gib else int(args.budget_mib * 2**20)
    h = client.attach(engine, budget_bytes=budget, server=args.server, job="deepspeed-llama-example")
    phase = max(1, args.steps // len(args.seq))
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    for step in range(args.steps):
        seq = args.seq[min(step // phase, len(args.seq) - 1)]
        for _ in range(args.accumulation):
            ids = torch.randint(0, 4096, (args.batch, seq), generator=data).to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()  # the last micro-batch's steps the optimizer, and the handle with it
        say(h, rank, step, seq, budget, loss)
    h.close()
    deepspeed.comm.destroy_process_group()  # DeepSpeed's own references to its groups go with it
    leave()


def leave() -> NoReturn:
    """End the rank without finalising the interpreter.

    DeepSpeed's engine and parameters keep their gloo groups alive past ``destroy_process_group``, and with
    them the groups' threads. One of those still releasing an all-gather's tensors when Python finalises
    aborts the rank ("terminate called without an active exception") after every step ran, with or without
    rematd: a race that a loaded CPU loses one run in four (docs/deepspeed.md).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
