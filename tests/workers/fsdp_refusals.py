"""One process (a one-rank gloo group): the sharded models ``attach`` refuses, each with what it said.

Blocks that hold FSDP units of their own (found at ``attach`` when sharded first, at the
first step when sharded after); blocks outside every unit of a sharded model. Also: a model sharded after
``attach`` in a way that works trains, and ``h.optimizer`` follows an optimizer made after sharding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from rematd import client
from tests.workers.fsdp_exact import VOCAB, build, layers, shard
from tests.workers.rank import finish, start


def refusal(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except client.UnsupportedModel as err:
        return str(err)
    return ""


def train_once(model: nn.Module) -> None:
    ids = torch.randint(0, VOCAB, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()


def main() -> None:
    start()
    said: dict[str, Any] = {}

    inner = build("llama")
    for layer in layers(inner):
        fully_shard(layer.mlp)
    fully_shard(inner)
    said["units_inside_blocks"] = refusal(lambda: client.attach(inner))

    late = build("llama")
    h = client.attach(late)
    for layer in layers(late):
        fully_shard(layer.mlp)
    fully_shard(late)
    said["units_inside_blocks_after_attach"] = refusal(lambda: train_once(late))
    h.close()

    partial = build("gpt2")
    fully_shard(partial.transformer.wte)
    said["blocks_outside_units"] = refusal(lambda: client.attach(partial))

    # Sharded after attach, the right way: it trains, and the handle follows the optimizer made afterwards.
    good = build("llama")
    h = client.attach(good)
    shard(good, {})
    opt = torch.optim.SGD(good.parameters(), lr=0.1)
    h.optimizer = opt
    for _ in range(2):
        train_once(good)
        opt.step()
        opt.zero_grad()
    said["steps_followed"] = h.step_count
    h.optimizer = None
    train_once(good)
    opt.step()
    said["steps_unfollowed"] = h.step_count
    h.close()

    finish(said)


if __name__ == "__main__":
    main()
