"""Checkpointing a model already does by itself: refused at ``attach``, with what to turn off.

rematd checkpoints the blocks itself, per block and per step. A model whose
library checkpoints its layers too (``activation_checkpointing_enable()``,
formerly ``gradient_checkpointing_enable()``, in ``transformers``;
``set_grad_checkpointing()`` in ``timm``) would run every layer checkpointed
inside rematd's choice: twice the recomputation, and profiles and plans that
measure the library's checkpointing instead of the block's own forward.
"""

from __future__ import annotations

from torch import nn

from rematd.client.errors import UnsupportedModel

# (attribute, how to turn it off) of the libraries that checkpoint their own layers.
_OWN_CHECKPOINTING = (
    (
        "gradient_checkpointing",
        "call model.activation_checkpointing_disable() (gradient_checkpointing_disable(), its older name) "
        "before attach, and with the Hugging Face Trainer leave TrainingArguments' activation_checkpointing "
        "(gradient_checkpointing) off",
    ),
    ("grad_checkpointing", "call model.set_grad_checkpointing(False) before attach"),
)


def refuse_own_checkpointing(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModel` when a module of ``model`` has its library's checkpointing on."""
    for name, m in model.named_modules():
        for attribute, way_out in _OWN_CHECKPOINTING:
            if getattr(m, attribute, False) is True:
                where = f" (at {name!r})" if name else ""
                raise UnsupportedModel(
                    f"{type(m).__name__}{where} has its own gradient checkpointing enabled ({attribute}=True); "
                    f"rematd chooses per block which activations to keep and would recompute twice. "
                    f"To let rematd plan, {way_out}; to keep the library's checkpointing, do not attach rematd."
                )
