"""What users already turned on: their library's gradient checkpointing (refused, saying what to change), LoRA
adapters from PEFT, mixed precision with a gradient scaler; and offload on a GPU. Each trains bitwise as without
rematd, or is refused at attach with the way out."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

from rematd import client
from rematd.client import UnsupportedModel

from .model_matrix import Case, train_side_by_side
from .test_models_transformers import CASES as TRANSFORMERS
from .test_models_vision import CASES as VISION
from .test_models_vision import classify, images, seeded

transformers = pytest.importorskip("transformers")


def test_hugging_face_gradient_checkpointing_is_refused_with_the_way_out() -> None:
    model = TRANSFORMERS["llama"]().build()
    # transformers 5 renamed gradient_checkpointing_enable (kept as a deprecated alias).
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    enable()
    with pytest.raises(UnsupportedModel, match=r"activation_checkpointing_disable\(\).*TrainingArguments"):
        client.attach(model)
    layer = model.model.layers[0]
    assert "forward" not in layer.__dict__, "a refused model is left untouched"
    disable()
    h = client.attach(model)
    assert h.blocks == ["model.layers.0", "model.layers.1"]
    h.close()


def test_timm_gradient_checkpointing_is_refused_with_the_way_out() -> None:
    model = VISION["timm-vit"]().build()
    model.set_grad_checkpointing(True)
    with pytest.raises(UnsupportedModel, match=r"set_grad_checkpointing\(False\)"):
        client.attach(model)
    model.set_grad_checkpointing(False)
    client.attach(model).close()


@pytest.mark.parametrize("name", ["llama", "gpt2-sdpa"])
def test_a_lora_model_trains_bitwise(name: str) -> None:
    peft = pytest.importorskip("peft")
    targets = {"llama": ["q_proj", "v_proj"], "gpt2-sdpa": ["c_attn"]}[name]

    def lora(model: nn.Module) -> nn.Module:
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=targets, task_type="CAUSAL_LM")
        wrapped: nn.Module = peft.get_peft_model(model, config)
        return wrapped

    h = train_side_by_side(TRANSFORMERS[name](), wrap=lora)
    assert h.blocks[0].startswith("base_model.model.") and len(h.blocks) == 2


def small_resnet() -> Case:
    """torchvision's ResNet with a basic block a stage, as resnet50 (``tests/test_models_vision.py``) residual
    blocks with batch norm but a tenth of its work: bfloat16's convolutions are slow on CPUs without its
    instructions. Images of 32 pixels: at 16 the last stage's strided 3x3 convolution sees a 1x1 input, where
    torch's CPU bfloat16 weight gradient is not deterministic (two identical backward passes differ, now and
    then by an infinity), with or without rematd."""
    resnet = pytest.importorskip("torchvision.models.resnet")
    build = seeded(lambda: resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1], num_classes=5))
    return Case(build, lambda seed: images(seed, size=32), classify)


@pytest.mark.parametrize(
    ("name", "dtype"), [("llama", torch.bfloat16), ("resnet", torch.bfloat16), ("gpt2-sdpa", torch.float16)]
)
def test_autocast_with_a_grad_scaler_trains_bitwise(name: str, dtype: torch.dtype) -> None:
    case = TRANSFORMERS[name]() if name in TRANSFORMERS else small_resnet()

    def autocast() -> contextlib.AbstractContextManager[object]:
        return torch.autocast("cpu", dtype=dtype)

    train_side_by_side(case, autocast=autocast, scaler=lambda: torch.amp.GradScaler("cpu"))


CUDA_CASES: dict[str, Callable[[], object]] = {"gpt2-sdpa": TRANSFORMERS["gpt2-sdpa"], "resnet50": VISION["resnet50"]}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload is offered on CUDA only (the CPU path: not offered)")
@pytest.mark.parametrize("name", list(CUDA_CASES))
def test_offload_on_cuda_trains_as_without_rematd(name: str) -> None:
    case = TRANSFORMERS[name]() if name in TRANSFORMERS else VISION[name]()
    train_side_by_side(case, device="cuda", offload=True)
