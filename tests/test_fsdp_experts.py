"""FSDP2 units with parameters on meshes of their own (torchtitan's experts under expert parallel), on 2 CPU ranks."""

from __future__ import annotations

from pathlib import Path

from .distributed import run_ranks


def test_experts_gathered_on_a_mesh_of_their_own_are_weights_not_activations(tmp_path: Path) -> None:
    for rank, r in enumerate(run_ranks("fsdp_experts", tmp_path, world=2, config={})):
        # Each block is one unit with two parameter groups: the experts' (a mesh of one rank) and the rest.
        assert r["groups"] == [2, 2, 2], r["groups"]
        # The experts' gathered bfloat16 weights, which their forward saves for backward, are FSDP's: freed
        # after the block's forward and gathered again in backward. The CPU's count leaves them out.
        assert r["experts_gathered"] == 2 * len(r["groups"]), r
        assert r["experts_left_out"] == r["experts_gathered"], (rank, r)
        # Both groups are gathered whole in bfloat16 and resharded after the forward: at backward's start FSDP
        # holds two blocks' parameters gathered, the running one and the prefetched one.
        assert r["gathered_at_peak"] == 2 * r["block_bytes"], (rank, r)
        for k, step in enumerate(r["steps"][1:], start=1):
            assert step["modes"] == ["STORE"] * 3, (rank, k, step)
            # What storing every block keeps, measured, is what the profile priced it at (as on one rank),
            # not that plus the experts' weights.
            assert step["measured"] == step["priced"], (rank, k, step, r["expert_bytes"])
