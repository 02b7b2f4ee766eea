"""torch's own encoder-decoder, ``nn.Transformer``: two equally long groups of blocks of different classes, in
an encoder and a decoder of their own, all found by default and trained bitwise as without rematd."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from rematd.client import BlockDiscoveryError, find_blocks

from .model_matrix import Case, train_side_by_side


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Transformer(
        d_model=32,
        nhead=2,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=64,
        dropout=0.1,
        batch_first=True,
    )


def batch(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"src": torch.randn(2, 10, 32, generator=gen), "tgt": torch.randn(2, 6, 32, generator=gen)}


def loss(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    out: torch.Tensor = model(inputs["src"], inputs["tgt"], tgt_mask=mask, tgt_is_causal=True)
    return out.pow(2).mean()


def test_encoder_and_decoder_blocks_are_all_found_and_train_bitwise() -> None:
    h = train_side_by_side(Case(build, batch, loss))
    assert h.blocks == ["encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1"]


def test_tied_groups_that_do_not_sit_apart_stay_ambiguous() -> None:
    """Side by side in one module, or one inside the other's: which runs first is not known, so blocks= decides."""
    enc = nn.TransformerEncoderLayer(32, 2, 64, batch_first=True)
    dec = nn.TransformerDecoderLayer(32, 2, 64, batch_first=True)
    outer = nn.Module()
    outer.encoder = nn.Module()
    outer.encoder.layers = nn.ModuleList([enc, copy.deepcopy(enc)])
    outer.encoder.inner = nn.Module()
    outer.encoder.inner.layers = nn.ModuleList([dec, copy.deepcopy(dec)])
    with pytest.raises(BlockDiscoveryError, match="equally long"):
        find_blocks(outer)
    side = nn.Module()
    side.a = nn.ModuleList([copy.deepcopy(enc), copy.deepcopy(enc)])
    side.b = nn.ModuleList([copy.deepcopy(dec), copy.deepcopy(dec)])
    with pytest.raises(BlockDiscoveryError, match=r"blocks=list\(model.a\)"):
        find_blocks(side)
