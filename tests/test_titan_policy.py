"""rematd's ``titan`` mode is torchtitan's ``selective`` (``SelectiveAC``), op for op: on a block of bias-free
linear layers, fused attention and a mixture of experts' router (``moe.router.gate``), both keep the outputs of
the same ops in the same order, and train bitwise alike."""

from __future__ import annotations

import functools
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if sys.version_info < (3, 11):
    pytest.skip("torchtitan needs Python 3.11 or later", allow_module_level=True)

from torch.utils.checkpoint import CheckpointPolicy

from rematd import client
from rematd.client.blocks import selective as rematd_selective
from rematd.planner import Mode

D, EXPERTS = 32, 4


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, EXPERTS, bias=False)


class Moe(nn.Module):
    """A router's top-1 choice scales one shared expert (enough for the policy: a router matmul, a topk)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.expert = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router.gate(x).softmax(-1)
        top, _ = scores.topk(1, dim=-1)
        out: torch.Tensor = self.expert(x) * top
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.moe = Moe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, 2, D // 2).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + self.wo(y)
        return x + self.moe(F.rms_norm(x, (D,)))


class LlamaLikeBlock(Block):
    """A block that ends as Llama's does: in a feed-forward whose last matmul's output no gradient needs, so
    that a recomputation stops before it (torch's checkpoint stops once backward has what it needs)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(D, 4 * D, bias=False), nn.Linear(D, 4 * D, bias=False)
        self.w2 = nn.Linear(4 * D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        h = F.rms_norm(x, (D,))
        out: torch.Tensor = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return out


class Model(nn.Module):
    def __init__(self, block: type[Block] = Block) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({str(i): block() for i in range(2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def test_titan_keeps_what_torchtitans_selective_keeps_and_trains_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan.distributed import activation_checkpoint as titan_ac

    theirs_said: list[tuple[str, bool]] = []
    ours_said: list[tuple[str, bool]] = []
    make_contexts = titan_ac.create_selective_checkpoint_contexts

    def recorded(policy: Any) -> Any:
        def said(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            decision = policy(ctx, func, *args, **kwargs)
            if not ctx.is_recompute:
                theirs_said.append((str(func), decision == CheckpointPolicy.MUST_SAVE))
            return decision  # type: ignore[no-any-return]

        return make_contexts(said)

    monkeypatch.setattr(titan_ac, "create_selective_checkpoint_contexts", recorded)
    own_policy = rematd_selective.TitanPolicy.__call__

    def our_recorded(self: Any) -> Any:
        decide = own_policy(self)

        def said(op: Any, args: Any, kwargs: Any) -> bool:
            keep = decide(op, args, kwargs)
            ours_said.append((str(op), keep))
            return keep

        return said

    monkeypatch.setattr(rematd_selective.TitanPolicy, "__call__", our_recorded)

    theirs, ours = Model(), Model()
    titan_ac.SelectiveAC(titan_ac.SelectiveAC.Config()).apply(theirs)
    h = client.attach(ours, budget_bytes=10**12)
    x = torch.randn(2, 8, D)
    ours(x).pow(2).mean().backward()  # the profiling step
    h.step()
    ours.zero_grad()
    h.pin_modes("titan")
    for step in range(2):
        theirs_said.clear()
        ours_said.clear()
        a, b = theirs(x).pow(2).mean(), ours(x).pow(2).mean()
        a.backward()
        b.backward()
        h.step()
        assert torch.equal(a, b), step
        for (name, p), q in zip(theirs.named_parameters(), ours.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), (step, name)
        theirs.zero_grad()
        ours.zero_grad()
        # The forward of each block: the same ops, each kept or not alike (a forward's decisions, then its
        # replay's in backward, on our side).
        forward = ours_said[: len(theirs_said)]
        assert forward == theirs_said, [(t, o) for t, o in zip(theirs_said, forward, strict=False) if t != o]
        kept = [op for op, keep in theirs_said if keep]
        assert any("mm" in op for op in kept) and any("topk" in op for op in kept), kept
    assert h.modes == (Mode.TITAN,) * 2
    h.close()


@pytest.mark.parametrize("block", [Block, LlamaLikeBlock])
def test_titan_holds_what_torchtitans_selective_holds(block: type[Block]) -> None:
    """By torch's memory profiler (every allocation, not rematd's count): what the recomputation has taken back
    from the kept outputs is not held past its use, as torchtitan's own checkpoint frees it."""
    from torchtitan.distributed import activation_checkpoint as titan_ac

    from bench.common import profiled_peak

    theirs, ours = Model(block), Model(block)
    titan_ac.SelectiveAC(titan_ac.SelectiveAC.Config()).apply(theirs)
    h = client.attach(ours, budget_bytes=10**12)
    x = torch.randn(8, 256, D)
    ours(x).pow(2).mean().backward()  # the profiling step
    h.step()
    h.pin_modes("titan")

    def step(model: Model) -> None:
        model(x).pow(2).mean().backward()
        if model is ours:
            h.step()
        model.zero_grad(set_to_none=False)

    try:
        peaks = []
        for model in (ours, theirs):
            step(model)  # gradients made, as every later step finds them
            peaks.append(profiled_peak(functools.partial(step, model)))
    finally:
        h.close()
    hidden = x.numel() * x.element_size()
    assert peaks[0] <= peaks[1] + hidden // 4, (peaks, hidden)


def test_the_compute_intensive_ops_named_are_the_compilers():
    """The policy names the partitioner's list rather than importing it (which imports dynamo); the two agree."""
    from torch._functorch.partitioners import get_default_op_list

    theirs = {getattr(op, "default", op) for op in get_default_op_list().compute_intensive_ops}
    assert set(rematd_selective._compute_intensive()) == theirs
