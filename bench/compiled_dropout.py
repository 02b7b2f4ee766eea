"""What ``torch._inductor.config.fallback_random`` costs a job trained with ``attach(..., compile=True)`` and dropout.

With it off, Inductor draws dropout's masks inside its generated kernels (other masks than eager's); on, it
calls eager's random ops (eager's masks, up to rounding). Both runs train the same GPT, every block
stored (the mode where dropout's kernels weigh most), and alternate so that the machine's load falls on
both alike; the median step after the compiles is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rematd import client
from rematd.client.demo.tiny_gpt import GPTConfig, TinyGPT, lm_loss


def _steps(fallback: bool, *, device: torch.device, cfg: GPTConfig, batch: int, seq: int, steps: int) -> list[float]:
    import torch._inductor.config as inductor

    with inductor.patch(fallback_random=fallback):
        torch.manual_seed(0)
        model = TinyGPT(cfg).to(device)
        h = client.attach(model, compile=True, modes=["recompute"])
        gen = torch.Generator().manual_seed(1)
        seconds = []
        for i in range(steps):
            h.pin_modes(None if i == 0 else "store")
            ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen).to(device)
            start = time.perf_counter()
            lm_loss(model, ids).backward()
            model.zero_grad(set_to_none=True)
            h.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        h.close()
    torch._dynamo.reset()
    return seconds[3:]  # the profiling step and the compiles are not the cost asked about


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model on the CPU")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each setting, alternating")
    parser.add_argument("--out", default="bench/compiled_dropout.json")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        cfg, batch, seq, steps = (
            GPTConfig(n_layer=12, d_model=1024, n_head=16, max_seq_len=1024, dropout=0.1),
            8,
            1024,
            20,
        )
    else:
        torch.set_num_threads(1)
        cfg, batch, seq, steps = GPTConfig(n_layer=4, d_model=256, n_head=4, max_seq_len=256, dropout=0.1), 4, 256, 12
    kept: dict[str, list[float]] = {"inductor random": [], "fallback_random": []}
    for _ in range(args.rounds):
        for name, fallback in (("inductor random", False), ("fallback_random", True)):
            kept[name] += _steps(fallback, device=device, cfg=cfg, batch=batch, seq=seq, steps=steps)
    medians = {name: statistics.median(s) for name, s in kept.items()}
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model": f"{cfg.n_layer} blocks, d_model {cfg.d_model}, batch {batch} x {seq}, dropout {cfg.dropout}",
        "median_step_seconds": medians,
        "fallback_random_cost_ratio": medians["fallback_random"] / medians["inductor random"] - 1,
    }
    print(json.dumps(report, indent=2))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
