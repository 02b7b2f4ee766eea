"""What attach accepts and refuses, copies of an attached model, and the rank it reports."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.optim.swa_utils import AveragedModel

from rematd import client
from rematd.client.demo.tiny_gpt import lm_loss
from rematd.planner import Mode

from .helpers import batch, service_thread, tiny_model, train_step

ACCEPTED_MODES = r"'store', 'selective', 'recompute', 'offload'"


BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"job": "my job"}, ValueError, r"^job must be 1-128 letters, digits.*got 'my job'"),
    ({"job": "-leading-dash"}, ValueError, r"^job must"),
    ({"job": "x" * 129}, ValueError, r"^job must"),
    ({"job": 7}, TypeError, r"^job must be a string"),
    ({"server": "localhost"}, ValueError, r"^server must be 'host:port'.*got 'localhost'"),
    ({"server": "localhost:"}, ValueError, r"^server must be 'host:port'"),
    ({"server": "localhost:70000"}, ValueError, r"^server must be 'host:port'"),
    ({"server": "::1:50051"}, ValueError, r"^server must be .*\[::1\]:50051"),
    ({"server": ""}, ValueError, r"^server must be"),
    ({"server": 50051}, TypeError, r"^server must be a 'host:port' string"),
    ({"budget_bytes": "lots"}, TypeError, r"^budget_bytes must be a positive number of bytes.*'lots'"),
    ({"budget_bytes": -5}, ValueError, r"^budget_bytes must be a positive number of bytes"),
    ({"budget_bytes": 0}, ValueError, r"^budget_bytes"),
    ({"budget_bytes": 1.5}, ValueError, r"^budget_bytes .*whole number"),
    ({"budget_bytes": math.inf}, ValueError, r"^budget_bytes"),
    ({"budget_bytes": True}, TypeError, r"^budget_bytes"),
    ({"budget_bytes": 2**64}, ValueError, r"^budget_bytes .*up to 2\*\*63-1"),
    ({"hard_limit_bytes": -1}, ValueError, r"^hard_limit_bytes must be a positive number of bytes"),
    ({"optimizer": "sgd"}, TypeError, r"^optimizer must be a torch\.optim\.Optimizer.*got str"),
    ({"margin_ratio": 1.0}, ValueError, r"^margin_ratio must be in \[0, 1\)"),
    ({"margin_ratio": -0.1}, ValueError, r"^margin_ratio must be in \[0, 1\)"),
    ({"margin_ratio": math.nan}, ValueError, r"^margin_ratio must be in \[0, 1\)"),
    ({"margin_ratio": "0.1"}, TypeError, r"^margin_ratio must be a number"),
    (
        {"modes": ["recompute", "teleport"]},
        ValueError,
        rf"^modes: unknown mode 'teleport'; accepted: {ACCEPTED_MODES}",
    ),
    ({"modes": "recompute"}, TypeError, r"^modes must be a list of modes"),
    ({"server": "localhost:50051", "tls": "yes"}, TypeError, r"^tls must be True or False"),
    ({"server": "localhost:50051", "fallback_after_s": -1}, ValueError, r"^fallback_after_s"),
    ({"offload": client.OffloadConfig()}, ValueError, r"^offload= configures the 'offload' mode.*add 'offload'"),
    ({"modes": ["offload"], "offload": 2}, TypeError, r"^offload must be an OffloadConfig or None, got 2"),
]


def _id(kwargs: dict[str, Any]) -> str:
    return ",".join(f"{k}={v!r}"[:24] for k, v in kwargs.items())


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD, ids=[_id(k) for k, _, _ in BAD])
def test_bad_arguments_are_refused_at_attach_naming_the_argument(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    model = tiny_model(n_layer=2, d_model=16)
    with pytest.raises(error, match=message):
        client.attach(model, **kwargs)
    # Refused before anything was hooked: the model is as it was.
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all("forward" not in block.__dict__ for block in model.h)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"job": "ft-llama_7b.run2", "budget_bytes": 2e9, "margin_ratio": 0, "modes": ["recompute", Mode.SELECTIVE]},
        {"server": "localhost:50051"},
        {"server": "[::1]:50051"},
        {"server": "dns:///rematd.example:50051", "tls": True},
        {"optimizer": torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)},
    ],
    ids=_id,
)
def test_good_arguments_are_accepted(kwargs: dict[str, Any]) -> None:
    h = client.attach(tiny_model(n_layer=2, d_model=16), **kwargs)
    h.close()


def test_budget_set_later_is_checked_like_at_attach() -> None:
    h = client.attach(tiny_model(n_layer=2, d_model=16))
    with pytest.raises(TypeError, match=r"^budget_bytes must be a positive number of bytes.*'lots'"):
        h.budget_bytes = "lots"  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"^budget_bytes"):
        h.budget_bytes = -1
    h.budget_bytes = 2e6  # type: ignore[assignment]
    assert h.budget_bytes == 2_000_000
    h.close()


def test_pin_modes_takes_names_or_mode_values_and_says_what_it_accepts() -> None:
    model = tiny_model(n_layer=2, d_model=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt, budget_bytes=10**12)
    train_step(model, opt, 16)
    h.pin_modes(["Recompute", Mode.STORE])
    train_step(model, opt, 16, seed=1)
    assert h.modes == (Mode.RECOMPUTE, Mode.STORE)
    with pytest.raises(ValueError, match=rf"^pin_modes: unknown mode 'teleport'; accepted: {ACCEPTED_MODES}"):
        h.pin_modes(["store", "teleport"])
    with pytest.raises(ValueError, match=r"^pin_modes: unknown mode 7"):
        h.pin_modes([7, 1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"^pin_modes: unknown mode 'ab'"):
        h.pin_modes("ab")
    with pytest.raises(TypeError, match=r"^pin_modes takes a mode for every block or a list of modes"):
        h.pin_modes({"store": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^pin_modes needs 2 modes, one per block, got 3"):
        h.pin_modes(["store"] * 3)
    h.pin_modes(None)
    h.close()


def test_models_compiled_in_place_are_refused() -> None:
    whole = tiny_model(n_layer=2, d_model=16)
    whole.compile()  # compiles lazily, at the first call: nothing runs here
    with pytest.raises(client.UnsupportedModel, match=r"compile"):
        client.attach(whole)
    part = tiny_model(n_layer=2, d_model=16)
    part.h[0].compile()
    with pytest.raises(client.UnsupportedModel, match=r"compile.*at 'h\.0'|at 'h\.0'.*compile"):
        client.attach(part)


def _is_own_forward(block: torch.nn.Module) -> bool:
    forward = block.forward
    return getattr(forward, "__func__", None) is type(block).forward and getattr(forward, "__self__", None) is block


def test_copies_of_an_attached_model_are_plain_unattached_models(tmp_path: Path) -> None:
    model = tiny_model(n_layer=2, d_model=16, dropout=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt, budget_bytes=10**12)
    train_step(model, opt, 16)
    h.pin_modes(["recompute", "recompute"])
    train_step(model, opt, 16, seed=1)
    assert h.modes == (Mode.RECOMPUTE, Mode.RECOMPUTE)

    averaged = AveragedModel(model)
    torch.save(model, tmp_path / "model.pt")
    copies = {
        "deepcopy": copy.deepcopy(model),
        "AveragedModel": averaged.module,
        "torch.save": torch.load(tmp_path / "model.pt", weights_only=False),
    }
    steps = h.step_count
    for name, twin in copies.items():
        assert all(_is_own_forward(block) for block in twin.h), name
        # Same parameters, same dropout draws: a plain model's loss and gradients, bitwise.
        plain = tiny_model(n_layer=2, d_model=16, dropout=0.1)
        plain.load_state_dict(model.state_dict())
        for m in (twin, plain):
            torch.manual_seed(3)
            lm_loss(m, batch(16, seed=3)).backward()
        for (pname, p), q in zip(plain.named_parameters(), twin.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), (name, pname)
        twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01)
        twin_opt.step()
        assert h.step_count == steps, f"the {name} copy drove the original's handle"

    averaged.update_parameters(model)
    train_step(model, opt, 16, seed=2)  # the original is still attached, and still recomputes
    assert h.step_count == steps + 1 and h.modes == (Mode.RECOMPUTE, Mode.RECOMPUTE)
    h.close()
    assert all("forward" not in block.__dict__ for block in model.h)


def test_rank_is_read_when_the_first_step_ends_so_attach_may_come_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with service_thread(tmp_path / "rematd.db") as bound:
        handles = []
        for job in (None, "shared-job"):  # streamed before the process group exists, with and without job=
            model = tiny_model(n_layer=2, d_model=16)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            named = {} if job is None else {"job": job}
            handles.append(
                (client.attach(model, optimizer=opt, budget_bytes=10**12, server=bound.grpc, **named), model, opt)
            )
        # In-process, without job=: no service shows jobs, so nothing to warn about.
        alone = tiny_model(n_layer=2, d_model=16)
        alone_opt = torch.optim.SGD(alone.parameters(), lr=0.01)
        handles.append((client.attach(alone, optimizer=alone_opt, budget_bytes=10**12), alone, alone_opt))
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
        try:
            # A real group of one; the torch calls that read it answer as rank 1 of 2 would.
            monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
            monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
            with caplog.at_level(logging.WARNING, logger="rematd.client"):
                for step in range(3):
                    for _, model, opt in handles:
                        train_step(model, opt, 16, seed=step)
            h = handles[0][0]
            assert all((handle.rank, handle.world_size) == (1, 2) for handle, _, _ in handles)
            assert h.stream is not None and handles[2][0].stream is None
            warnings = [r.getMessage() for r in caplog.records if "separate job" in r.getMessage()]
            assert len(warnings) == 1 and h.job in warnings[0], "warned once, for the streamed handle without job="
        finally:
            for handle, _, _ in handles:
                handle.close()
            dist.destroy_process_group()
