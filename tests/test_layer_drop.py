"""Layer drop (OPT's ``layerdrop``): blocks skipped in the profiling step borrow a profile; a step that ran no
block profiles again (a stock ``transformers`` OPT from a small config, on the CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rematd import client
from rematd.client import introspect

transformers = pytest.importorskip("transformers")


def _opt(layerdrop: float) -> Any:
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=6,
        ffn_dim=64,
        num_attention_heads=2,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        layerdrop=layerdrop,
        use_cache=False,
    )
    return transformers.OPTForCausalLM(cfg).train()


def _step(model: Any, opt: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_blocks_dropped_while_profiling_borrow_the_largest_profile() -> None:
    model = _opt(layerdrop=0.5)
    layers = model.model.decoder.layers
    ran: set[int] = set()
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda *_, i=i: ran.add(i))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt, budget_bytes=10**7, planner_thread=False)
    _step(model, opt, 0)
    assert 0 < len(ran) < len(layers), f"the profiling step dropped some blocks and ran others: {sorted(ran)}"
    measures = [b.measure for b in introspect.blocks(h)]
    assert all(m is not None for m in measures), "every block has a profile after the first step"
    largest = max((measures[i] for i in ran), key=lambda m: m.saved_bytes)  # type: ignore[union-attr]
    assert all(measures[i] == largest for i in range(len(layers)) if i not in ran), "the dropped ones borrowed it"
    _step(model, opt, 1)
    assert h.plan.version >= 1 and len(h.modes) == len(layers), "planned from the second step on"
    h.close()


def test_a_profiling_step_that_ran_no_block_profiles_again() -> None:
    model = _opt(layerdrop=1.0)  # every block dropped
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt, budget_bytes=10**7, planner_thread=False)
    _step(model, opt, 0)
    _step(model, opt, 1)
    assert h.plan.version == 0 and all(b.measure is None for b in introspect.blocks(h)), "nothing to plan from yet"
    model.model.decoder.layerdrop = 0.0
    _step(model, opt, 2)
    assert all(b.measure is not None for b in introspect.blocks(h))
    _step(model, opt, 3)
    assert h.plan.version >= 1
    h.close()
