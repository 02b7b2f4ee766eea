"""torchvision and timm models, built with random weights, trained with rematd attached by default through store,
selective and recompute: losses, gradients, parameters and batch-norm statistics bitwise as without it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from .model_matrix import Case, train_side_by_side


def images(seed: int, *, size: int = 32) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(2, 3, size, size, generator=gen), "y": torch.tensor([1, 3])}


def classify(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(inputs["x"]), inputs["y"])


def seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return build()

    return make


def resnet50() -> Case:
    models = pytest.importorskip("torchvision.models")
    return Case(seeded(lambda: models.resnet50(num_classes=5)), images, classify)


def timm_vit() -> Case:
    timm = pytest.importorskip("timm")
    return Case(
        seeded(
            lambda: timm.create_model(
                "vit_tiny_patch16_224",
                pretrained=False,
                img_size=16,
                patch_size=4,
                embed_dim=32,
                depth=2,
                num_heads=2,
                num_classes=5,
                drop_rate=0.1,
                proj_drop_rate=0.1,
                attn_drop_rate=0.1,
                drop_path_rate=0.1,
            )
        ),
        lambda seed: images(seed, size=16),
        classify,
    )


def timm_convnext() -> Case:
    timm = pytest.importorskip("timm")
    return Case(
        seeded(
            lambda: timm.create_model(
                "convnext_atto",
                pretrained=False,
                depths=(1, 1, 2, 1),
                dims=(8, 16, 24, 32),
                num_classes=5,
                drop_path_rate=0.1,
            )
        ),
        images,
        classify,
    )


CASES: dict[str, Callable[[], Case]] = {"resnet50": resnet50, "timm-vit": timm_vit, "timm-convnext": timm_convnext}

BLOCKS = {
    "resnet50": [f"layer{s}.{i}" for s, n in ((1, 3), (2, 4), (3, 6), (4, 3)) for i in range(n)],
    "timm-vit": ["blocks.0", "blocks.1"],
    # A stage holds its own list of blocks (and a downsampling layer): the stages are the blocks.
    "timm-convnext": ["stages.0", "stages.1", "stages.2", "stages.3"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_trains_bitwise_as_without_rematd(name: str) -> None:
    h = train_side_by_side(CASES[name]())
    assert h.blocks == BLOCKS[name], "the blocks docs/client.md's table lists"
