"""One rank: what ``attach`` says of DeepSpeed set-ups it refuses, and ZeRO-3's memory as the plan sees it."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
from torch import nn

from rematd import client
from rematd.client import introspect
from rematd.client.parallel.zero import Zero3
from tests.workers.deepspeed_models import VOCAB, build, ds_config
from tests.workers.rank import finish, settings


def said(fn: Any) -> str:
    try:
        fn()
    except (TypeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "nothing"


def engine_for(config: dict[str, Any]) -> Any:
    model = build("gpt2")
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config
    )
    return engine


def refusals() -> dict[str, str]:
    own = {**ds_config({"stage": 2}), "activation_checkpointing": {"partition_activations": True}}
    pipe = deepspeed.pipe.PipelineModule(layers=[nn.Linear(4, 4), nn.Linear(4, 4)], num_stages=1)
    engine = engine_for(ds_config({"stage": 2}))
    h = client.attach(engine)
    out = {
        "own_checkpointing": said(lambda: client.attach(engine_for(own))),
        "pipeline": said(lambda: client.attach(pipe)),
        "not_an_engine": said(lambda: setattr(h, "engine", torch.optim.SGD(pipe.parameters(), lr=0.1))),
    }
    h.close()
    deepspeed.checkpointing.configure(None)
    out["configured"] = said(lambda: client.attach(build("gpt2")))
    return out


def memory() -> dict[str, Any]:
    """A ZeRO-3 step with every block stored: the figures the plan's static memory is made of."""
    engine = engine_for(ds_config({"stage": 3}))
    h = client.attach(engine)
    for seed in range(2):
        step(engine, seed)
    zero = introspect.cycle(h).setup
    assert isinstance(zero, Zero3) and h.last_stats is not None
    names = dict(engine.module.named_modules())
    out = {
        "full_param_bytes": sum(p.ds_numel * 4 for p in engine.module.parameters()),
        "largest_block_bytes": max(sum(p.ds_numel * 4 for p in names[n].parameters()) for n in h.blocks),
        "gathered_at_peak": zero.gathered_at_peak,
        "shard_bytes": zero.shard_bytes(engine),
        "static": h.last_stats.static_bytes,
        "step_count": h.step_count,
    }
    h.close()
    step(engine, 2)  # closed: the engine steps as its own, the handle no more
    out["steps_after_close"] = h.step_count - out["step_count"]
    out["engine_step_restored"] = "step" not in engine.__dict__
    return out


def step(engine: Any, seed: int) -> None:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def main() -> None:
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    finish(memory() if settings() == "memory" else refusals(), exit_now=True)


if __name__ == "__main__":
    main()
