"""The solver's plans on many random profiles, against plans recorded in ``tests/data/solver_plans.json``:
a change meant to make the solver faster must leave every plan, its predicted peak and its seconds as
they were. ``python -m tests.test_solver_plans`` re-records them (only for a change meant to alter plans).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rematd.planner import BlockCost, Profile
from rematd.planner.knapsack import Knapsack
from rematd.planner.solvers import solve_prepared

from .test_knapsack import block
from .test_planner import REF

RECORDED = Path(__file__).parent / "data" / "solver_plans.json"
LETTER = "?.sRO"


def random_blocks(rng: random.Random) -> list[BlockCost]:
    """Blocks of a few kinds repeated (as models are) or every block unlike the others (the worst case)."""
    n = rng.choice([3, 8, 12, 13, 40, 150, 400])
    kinds = n if rng.random() < 0.5 else rng.randint(1, 4)
    made = [
        block(rng.randint(1, 5000), rng.randint(0, 5000), rng.randint(0, 1000), rng.random(), 2 * rng.random())
        for _ in range(kinds)
    ]
    return [made[i % kinds] for i in range(n)]


def cases() -> list[dict[str, Any]]:
    """Every recorded case: the solver's answer at five targets per profile, with and without outside memory."""
    out = []
    for seed in range(40):
        rng = random.Random(seed)
        blocks = random_blocks(rng)
        options = Profile(blocks=tuple(blocks), shape=REF).options_at()
        knapsack = Knapsack(options)
        store = sum(b.saved_bytes for b in blocks)
        outside = rng.choice([0, store // 10])
        in_backward = rng.random() < 0.5
        for frac in (0.05, 0.2, 0.4, 0.6, 0.85):
            choice = solve_prepared(
                knapsack, options, int(store * frac), outside_bytes=outside, outside_in_backward=in_backward
            )
            out.append(
                {
                    "seed": seed,
                    "frac": frac,
                    "modes": "".join(LETTER[int(m)] for m in choice.modes),
                    "peak": choice.predicted_peak_bytes,
                    "seconds": round(choice.extra_seconds, 9),
                    "fits": choice.fits,
                }
            )
    return out


def test_plans_are_the_recorded_ones() -> None:
    recorded = json.loads(RECORDED.read_text())
    got = cases()
    assert len(got) == len(recorded) == 200
    for now, then in zip(got, recorded, strict=True):
        assert now == then


if __name__ == "__main__":
    RECORDED.write_text(json.dumps(cases(), indent=0) + "\n")
