"""``compile=True`` with dropout: which settings give eager rematd's numbers (CPU, one tiny model).

Inductor draws dropout's random numbers in its own generated code, so its masks are not eager's;
``torch._inductor.config.fallback_random = True`` makes it call eager's random ops instead. The
``aot_eager`` backend runs eager's aten ops and is bitwise equal.
"""

from __future__ import annotations

import torch

from rematd import client
from rematd.client.models import lm_loss
from tests.helpers import batch, tiny_model

STEPS: list[tuple[int, list[str] | None]] = [(8, None), (8, ["store", "store"]), (8, ["recompute", "store"])]


def _grads(compile: bool | str) -> list[list[torch.Tensor]]:
    model = tiny_model(n_layer=2, d_model=32, dropout=0.1, seed=4)
    h = client.attach(model, compile=compile, modes=["recompute"])
    out = []
    for i, (seq, pin) in enumerate(STEPS):
        h.pin_modes(pin)
        lm_loss(model, batch(seq, seed=i)).backward()
        out.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        h.step()
    h.close()
    return out


def _largest_relative_error(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    return max(
        float((x - y).abs().max() / y.abs().max().clamp_min(1e-12))
        for sa, sb in zip(a, b, strict=True)
        for x, y in zip(sa, sb, strict=True)
    )


def test_dropout_under_compile_matches_eager_only_with_eager_random_numbers() -> None:
    import torch._inductor.config as inductor

    eager = _grads(False)
    assert _largest_relative_error(_grads("aot_eager"), eager) == 0.0, "aot_eager: eager's ops, bit for bit"
    with inductor.patch(fallback_random=False):
        own = _largest_relative_error(_grads(True), eager)
    with inductor.patch(fallback_random=True):
        fallback = _largest_relative_error(_grads(True), eager)
    assert own > 1e-3, f"Inductor's own random numbers are other masks: {own:.1e}"
    assert fallback < 1e-5, f"with fallback_random, only compile's rounding is left: {fallback:.1e}"
