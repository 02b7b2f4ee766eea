"""``compile=True`` with dropout: which settings give eager rematd's numbers (CPU, one tiny model).

Inductor draws dropout's random numbers in its own generated code, so its masks are not eager's;
``torch._inductor.config.fallback_random = True`` makes it call eager's random ops instead. The
``aot_eager`` backend runs eager's aten ops and is bitwise equal.
"""

from __future__ import annotations

import torch

from tests.test_compiled import _largest_relative_error, _train

STEPS: list[tuple[int, list[str] | None]] = [(8, None), (8, ["store", "store"]), (8, ["recompute", "store"])]


def _error_against_eager(compile: bool | str, eager: list[list[torch.Tensor]]) -> float:
    grads, h, _ = _train(compile, STEPS, modes=["recompute"], dropout=0.1)
    h.close()
    return max(_largest_relative_error(g, e) for g, e in zip(grads, eager, strict=True))


def test_dropout_under_compile_matches_eager_only_with_eager_random_numbers() -> None:
    import torch._inductor.config as inductor

    eager = _train(False, STEPS, modes=["recompute"], dropout=0.1)[0]
    assert _error_against_eager("aot_eager", eager) == 0.0, "aot_eager: eager's ops, bit for bit"
    with inductor.patch(fallback_random=False):
        own = _error_against_eager(True, eager)
    with inductor.patch(fallback_random=True):
        fallback = _error_against_eager(True, eager)
    assert own > 1e-3, f"Inductor's own random numbers are other masks: {own:.1e}"
    assert fallback < 1e-5, f"with fallback_random, only compile's rounding is left: {fallback:.1e}"
