"""On the CPU, rematd's modes hold what the plain torch they stand for holds, by torch's memory profiler (every
allocation, not rematd's own count): pinned to recompute, what ``torch.utils.checkpoint`` around each block
holds; pinned to store, what the model holds without checkpointing. rematd's bookkeeping (its saved-tensor
accounting, its hooks on the blocks' outputs) must not keep a tensor alive past the time torch frees it."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bench.common import profiled_peak
from rematd import client
from rematd.client import introspect
from rematd.client.demo.tiny_gpt import lm_loss
from tests.helpers import batch, tiny_model

LAYERS, WIDTH, SEQ, SIZE = 4, 64, 128, 4


class Checkpointed(nn.Module):
    """A block under ``torch.utils.checkpoint``, as users wrap theirs."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.block, x, use_reentrant=False)
        return out


def _peak(model: nn.Module, data: torch.Tensor, after_step: functools.partial[None] | None = None) -> int:
    def step() -> None:
        lm_loss(model, data).backward()
        if after_step is not None:
            after_step()
        model.zero_grad(set_to_none=False)

    step()  # gradients made, as every later step finds them
    return profiled_peak(step)


@pytest.mark.parametrize("mode", ["recompute", "store"])
def test_pinned_modes_hold_what_plain_torch_holds(mode: str) -> None:
    data = batch(SEQ, size=SIZE, seed=1)
    theirs = tiny_model(n_layer=LAYERS, d_model=WIDTH, seed=2)
    if mode == "recompute":
        theirs.h = nn.ModuleList(Checkpointed(b) for b in theirs.h)
    ours = tiny_model(n_layer=LAYERS, d_model=WIDTH, seed=2)
    h = client.attach(ours, budget_bytes=2**40)
    lm_loss(ours, data).backward()  # the profiling step
    h.step()
    h.pin_modes(mode)
    try:
        ours_peak = _peak(ours, data, functools.partial(h.step))
        theirs_peak = _peak(theirs, data)
    finally:
        h.close()
    block_output = SIZE * SEQ * WIDTH * 4
    # A block's output is the unit that a reference kept too long costs: rematd's own small records (its
    # step's figures, the checkpoint's RNG states) stay well under it.
    assert ours_peak <= theirs_peak + block_output // 4, (mode, ours_peak, theirs_peak, block_output)


def test_kept_outputs_the_recomputation_did_not_take_back_are_freed_when_it_ends() -> None:
    """Backward needs nothing of a block's last linear layer's output (the residual's sum passes its gradient
    through), so the checkpoint stops recomputing before it: the output the forward kept of it must not live on
    through the rest of the block's backward."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from rematd.client.blocks.selective import megatron_policy, selective_context

    torch.manual_seed(0)
    first, last = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def block(x: torch.Tensor) -> torch.Tensor:
        return x + last(torch.relu(first(x)))

    x = torch.randn(SEQ, WIDTH, requires_grad=True)
    sink: list[torch.Tensor] = []
    y = checkpoint(block, x, use_reentrant=False, context_fn=selective_context(sink, megatron_policy))
    kept = [StorageWeakRef(t.untyped_storage()) for t in sink]
    assert len(kept) == 2, "both linear layers' outputs kept"
    sink.clear()
    alive: list[list[bool]] = []
    # The last layer's weight gradient comes after the recomputation and before the block's backward ends.
    last.weight.register_hook(lambda _grad: alive.append([not ref.expired() for ref in kept]))
    y.sum().backward()
    assert alive == [[False, False]], alive


@pytest.mark.parametrize("mode", ["selective", "titan"])
def test_kept_outputs_backward_does_not_need_are_priced_and_counted_as_let_go(mode: str) -> None:
    """In the tiny GPT's block the outputs of the query/key/value projection (split into heads that attention
    copies), of the attention's projection and of the MLP's last layer (both summed into the residual) are kept
    by Megatron's policy but saved by no op: priced as let go when the block rematerialises, and counted so on
    the CPU, so that the step's count meets the plan's prediction rather than exceeding it by them."""
    from rematd.planner import MODES_BY_LABEL

    data = batch(SEQ, size=SIZE, seed=1)
    model = tiny_model(n_layer=LAYERS, d_model=WIDTH, seed=2)
    h = client.attach(model, budget_bytes=2**40)
    try:
        lm_loss(model, data).backward()  # the profiling step
        h.step()
        hidden = SIZE * SEQ * WIDTH * 4
        measure = introspect.blocks(h)[0].measure
        assert measure is not None
        cost = next(m for m in measure.modes if m.mode == MODES_BY_LABEL[mode])
        if mode == "selective":
            # Kept: the projection to queries, keys and values (3 hidden), attention's projection, the MLP's
            # first layer (4 hidden, saved by its activation) and its last; let go: all but the first layer's.
            assert measure.kept_needed[cost.mode] == (False, False, True, False)
            assert cost.released.bytes == 5 * hidden, (cost.released.bytes, hidden)
        assert 0 < cost.released.bytes < cost.kept.bytes
        h.pin_modes(mode)
        for _ in range(2):
            lm_loss(model, data).backward()
            h.step()
            model.zero_grad()
        measured, predicted = h.last_stats.saved_peak_bytes, h.plan.predicted_peak_bytes
        assert abs(measured - predicted) <= hidden // 16, (measured, predicted, hidden)
    finally:
        h.close()
