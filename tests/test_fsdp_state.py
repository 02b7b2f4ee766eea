"""FSDP's private state read for the CPU's figures: where a torch's internals differ, the figures fall back and
the log says so once, not at every step."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from rematd.client.parallel import fsdp


def test_an_unreadable_unit_falls_back_and_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    unit = model[0]

    def unreadable(m: nn.Module) -> list[object]:
        raise AttributeError("_fsdp_param_groups")

    monkeypatch.setattr(fsdp, "is_unit", lambda m: m is unit)
    monkeypatch.setattr(fsdp, "_fsdp_params", unreadable)
    monkeypatch.setattr(fsdp, "_param_groups", unreadable)
    monkeypatch.setattr(fsdp, "_UNREADABLE", set())
    with caplog.at_level(logging.WARNING, logger="rematd.client"):
        for _ in range(3):  # read at every step's start
            assert fsdp.gathered_storages(model) == frozenset()
        # The unit's parameters stand in, as the module holds them.
        assert len(fsdp.sharded_parameters(model)) == 4
        assert fsdp.unit_memory(unit).unsharded_bytes == (16 + 4) * 4
    said = [r.getMessage() for r in caplog.records if "cannot read FSDP" in r.getMessage()]
    assert len(said) == 1, said
    assert "Linear" in said[0] and "AttributeError" in said[0]
