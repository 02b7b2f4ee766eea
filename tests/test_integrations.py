"""The Hugging Face Trainer and PyTorch Lightning train through rematd's callbacks: attached at the start, a
rematd step per optimizer step, plans switching modes, closed at the end; and the callbacks' checks."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from rematd.planner import Mode

from .test_models_transformers import CASES as TRANSFORMERS

transformers = pytest.importorskip("transformers")


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 12, seq: int = 12) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 64, (n, seq), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_args(tmp_path: Any, steps: int, **more: Any) -> Any:
    """The Trainer's arguments for a short CPU run that writes nothing."""
    return transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=steps,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        **more,
    )


def _selective_after_profile(h: Any) -> None:
    """Pins every block selective once the profile is in (what a tight plan would do)."""
    if h.step_count == 1:
        h.pin_modes([Mode.SELECTIVE] * len(h.blocks))


def test_the_hugging_face_trainer_trains_through_the_callback(tmp_path: Any) -> None:
    from rematd.integrations import RematdTrainerCallback

    model = TRANSFORMERS["llama"]().build()
    seen: list[tuple[int, tuple[Mode, ...]]] = []

    class Watch(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            h = rematd.handle
            assert h is not None
            seen.append((h.step_count, h.modes))
            _selective_after_profile(h)

    rematd = RematdTrainerCallback(budget_bytes=2**40)
    args = hf_args(tmp_path, 3, gradient_accumulation_steps=2, learning_rate=1e-3)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[rematd, Watch()])
    result = trainer.train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    h = rematd.handle
    assert h is not None and h.closed, "closed when training ends"
    # The rematd callback runs first: each optimizer step (two micro-batches) is one rematd step.
    assert [count for count, _ in seen] == [1, 2, 3]
    assert seen[0][1] == (Mode.RECOMPUTE, Mode.RECOMPUTE), "the profiling step recomputes every block"
    assert seen[2][1] == (Mode.SELECTIVE, Mode.SELECTIVE), "pinned modes took effect at the next step"
    assert "forward" not in model.model.layers[0].__dict__, "the blocks' own forward is back"


def test_the_trainer_with_its_own_checkpointing_is_refused(tmp_path: Any) -> None:
    from rematd.client import UnsupportedModel
    from rematd.integrations import RematdTrainerCallback

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, activation_checkpointing=True
    )
    model = TRANSFORMERS["llama"]().build()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[RematdTrainerCallback()])
    with pytest.raises(UnsupportedModel, match="activation_checkpointing"):
        trainer.train()


def test_lightning_trains_through_the_callback() -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from rematd.integrations import RematdCallback

    class LM(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = TRANSFORMERS["gpt2-sdpa"]().build()

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(**batch).loss
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    seen: list[tuple[int, tuple[Mode, ...]]] = []

    class Watch(pl.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, *args: Any) -> None:
            h = rematd.handle
            assert h is not None
            seen.append((h.step_count, h.modes))
            _selective_after_profile(h)

    rematd = RematdCallback(budget_bytes=2**40)
    module = LM()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        accumulate_grad_batches=2,
        callbacks=[rematd, Watch()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2)
    trainer.fit(module, loader)
    assert trainer.global_step == 3
    h = rematd.handle
    assert h is not None and h.closed
    assert h.blocks == ["transformer.h.0", "transformer.h.1"], "attached to the network training_step calls"
    # Six micro-batches, two per optimizer step: a rematd step ends with each optimizer step only.
    assert [count for count, _ in seen] == [0, 1, 1, 2, 2, 3]
    assert seen[-1][1] == (Mode.SELECTIVE, Mode.SELECTIVE)
    assert "forward" not in module.model.transformer.h[0].__dict__


@pytest.mark.parametrize("make", ["RematdTrainerCallback", "RematdCallback"])
def test_callbacks_check_their_options(make: str) -> None:
    import rematd.integrations as integrations

    cls = getattr(integrations, make)
    with pytest.raises(TypeError, match="unknown attach option 'budget'"):
        cls(budget=10)
    with pytest.raises(TypeError, match="optimizer= itself"):
        cls(optimizer=torch.optim.SGD(nn.Linear(1, 1).parameters()))


def test_rematd_imports_without_the_frameworks() -> None:
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None; sys.modules['lightning'] = None\n"
        "import rematd.integrations, rematd.client\n"
        "try:\n"
        "    rematd.integrations.RematdCallback\n"
        "except ImportError as e:\n"
        "    print('refused', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.startswith("refused"), out.stdout + out.stderr


def test_a_failed_hugging_face_training_closes_the_handle(tmp_path: Any) -> None:
    """The Trainer calls no callback when training fails: the model must not be left with rematd's hooks."""
    from rematd.integrations import RematdTrainerCallback

    class Failing(transformers.Trainer):  # type: ignore[misc]
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss: torch.Tensor = super().training_step(*args, **kwargs)
            if self.state.global_step == 1:
                raise RuntimeError("a bad batch")
            return loss

    model = TRANSFORMERS["llama"]().build()
    rematd = RematdTrainerCallback(budget_bytes=2**40)
    args = hf_args(tmp_path, 3)
    trainer = Failing(model=model, args=args, train_dataset=Tokens(), callbacks=[rematd])
    with pytest.raises(RuntimeError, match="a bad batch"):
        trainer.train()
    h = rematd.handle
    assert h is not None and h.step_count == 1, "it failed in the second step"
    assert h.closed, "closed when training failed"
    assert "forward" not in model.model.layers[0].__dict__, "the blocks' own forward is back"
    assert not model._forward_pre_hooks and not model._forward_hooks, "no hook left on the model"
    assert "training_step" not in trainer.__dict__, "the trainer is as it was"
