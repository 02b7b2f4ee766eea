"""Pins and budget changes through the Hugging Face Trainer's and Lightning's callbacks: given as arguments
before training, or set on the callback while it trains; each applies from the next optimizer step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rematd.planner import Mode

from .test_integrations import Tokens, hf_args
from .test_models_transformers import CASES as TRANSFORMERS

transformers = pytest.importorskip("transformers")


def test_the_trainer_callback_pins_from_its_argument_and_takes_a_budget_while_training(tmp_path: Any) -> None:
    from rematd.integrations import RematdTrainerCallback

    # Planned on the training thread: each control is in force at the very next step (the options go to attach).
    rematd = RematdTrainerCallback(budget_bytes=2**40, pin_modes="recompute", planner_thread=False)
    seen: list[tuple[int, int, tuple[Mode, ...]]] = []

    class Watch(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            h = rematd.handle
            assert h is not None
            seen.append((h.step_count, h.plan.version, h.modes))
            if h.step_count == 2:
                rematd.pin_modes(None)  # the planner's plans again, from the next step
            if h.step_count == 3:
                rematd.budget_bytes = 1  # nothing fits: the leanest plan, from the next step

    model = TRANSFORMERS["llama"]().build()
    trainer = transformers.Trainer(
        model=model, args=hf_args(tmp_path, 4, learning_rate=1e-3), train_dataset=Tokens(), callbacks=[rematd, Watch()]
    )
    trainer.train()
    assert [m for _, _, m in seen] == [
        (Mode.RECOMPUTE, Mode.RECOMPUTE),  # profiling: every block recomputed
        (Mode.RECOMPUTE, Mode.RECOMPUTE),  # the pin given as an argument
        (Mode.STORE, Mode.STORE),  # unpinned: a 1 TiB budget needs nothing
        seen[3][2],
    ]
    assert seen[3][1] > seen[2][1] and all(m != Mode.STORE for m in seen[3][2]), "the new budget's plan at once"
    assert rematd.budget_bytes == 1


def test_the_lightning_callback_takes_pins_and_budgets_from_training_step() -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from rematd.integrations import RematdCallback

    rematd = RematdCallback(budget_bytes=2**40, planner_thread=False)  # each control in force at the next step
    seen: list[tuple[int, tuple[Mode, ...]]] = []

    class LM(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = TRANSFORMERS["gpt2-sdpa"]().build()

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            h = rematd.handle
            assert h is not None
            seen.append((h.step_count, h.modes))
            if index == 1:
                rematd.pin_modes(["store", "recompute"])
            if index == 2:
                rematd.pin_modes(None)
                rematd.budget_bytes = 1
            loss: torch.Tensor = self.model(**batch).loss
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        callbacks=[rematd],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LM(), torch.utils.data.DataLoader(Tokens(), batch_size=2))
    h = rematd.handle
    assert h is not None
    # training_step runs before its step's forward: what it sets shows in the step after.
    assert [count for count, _ in seen] == [0, 1, 2, 3]
    assert seen[2][1] == (Mode.STORE, Mode.RECOMPUTE), "the pin set by the step before"
    assert all(m != Mode.STORE for m in seen[3][1]), "the new budget's plan at once"


@pytest.mark.parametrize("make", ["RematdTrainerCallback", "RematdCallback"])
def test_callbacks_check_pins_and_budgets(make: str) -> None:
    import rematd.integrations as integrations

    cls = getattr(integrations, make)
    with pytest.raises(ValueError, match=r"^pin_modes: unknown mode 'teleport'"):
        cls(pin_modes="teleport")
    with pytest.raises(TypeError, match=r"^pin_modes takes a mode for every block"):
        cls(pin_modes=3)
    callback = cls(budget_bytes=5_000_000)
    assert callback.budget_bytes == 5_000_000
    with pytest.raises(ValueError, match=r"^budget_bytes"):
        callback.budget_bytes = -1
    callback.budget_bytes = 7_000_000
    assert callback.budget_bytes == 7_000_000, "kept for the handle it attaches"


def test_a_pin_that_does_not_fit_the_model_stops_training_before_it_starts(tmp_path: Any) -> None:
    from rematd.integrations import RematdTrainerCallback

    model = TRANSFORMERS["llama"]().build()
    rematd = RematdTrainerCallback(pin_modes=["store"] * 3)
    trainer = transformers.Trainer(model=model, args=hf_args(tmp_path, 2), train_dataset=Tokens(), callbacks=[rematd])
    with pytest.raises(ValueError, match=r"^pin_modes needs 2 modes, one per block, got 3"):
        trainer.train()
    assert not model._forward_pre_hooks and not model._forward_hooks, "the model is left as it was"
    assert "forward" not in model.model.layers[0].__dict__


def _lightning_run(pl: Any, *, rematd: bool, use_cache: bool) -> list[torch.Tensor]:
    """A tiny GPT-2 trained by Lightning (dropout on, two micro-batches a step); its final parameters."""
    from rematd.integrations import RematdCallback

    class LM(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(11)
            self.model = TRANSFORMERS["gpt2-sdpa"]().build()
            self.model.config.use_cache = use_cache

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            if rematd and index == 2:
                callback.pin_modes(["recompute", "selective"])
            loss: torch.Tensor = self.model(**batch).loss
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    callback = RematdCallback(budget_bytes=2**40)
    module = LM()
    module.model.train()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        accumulate_grad_batches=2,
        callbacks=[callback] if rematd else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    pl.seed_everything(3, verbose=False)
    trainer.fit(module, torch.utils.data.DataLoader(Tokens(), batch_size=2))
    return [p.detach().clone() for p in module.parameters()]


def test_lightning_through_rematd_is_bitwise_the_plain_run_with_the_cache_off() -> None:
    pl = pytest.importorskip("lightning.pytorch")
    plain = _lightning_run(pl, rematd=False, use_cache=False)
    ours = _lightning_run(pl, rematd=True, use_cache=True)  # rematd turns the cache off in training forwards
    assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
    cached = _lightning_run(pl, rematd=False, use_cache=True)
    diff = max(float((a - b).abs().max()) for a, b in zip(cached, ours, strict=True))
    # The cache the plain run builds may change the order of float sums: close (1.1e-6 measured), if not equal.
    assert diff < 1e-4, diff
