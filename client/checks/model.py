"""What ``attach`` refuses in any set-up: compiled modules, and libraries' own checkpointing."""

from __future__ import annotations

from torch import nn

from rematd.client.checks.own_checkpointing import refuse_own_checkpointing
from rematd.client.errors import UnsupportedModel


def _compiled(m: nn.Module) -> bool:
    # torch.compile(m) wraps it (an OptimizedModule holding _orig_mod); m.compile() compiles in place,
    # leaving the compiled call in _compiled_call_impl.
    return (
        type(m).__name__ == "OptimizedModule"
        or hasattr(m, "_orig_mod")
        or (getattr(m, "_compiled_call_impl", None) is not None)
    )


def check_module(model: object) -> nn.Module:
    """``model``, when rematd can switch its blocks; :class:`UnsupportedModel` (or ``TypeError``) otherwise."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach expects an nn.Module, got {type(model).__name__}")
    for name, m in model.named_modules():
        where = f" (at {name!r})" if name else ""
        kind = type(m).__name__
        if _compiled(m):
            raise UnsupportedModel(
                f"{kind}{where} is compiled with torch.compile or .compile(); rematd switches checkpointing "
                "between steps, which a compiled graph does not see. Attach to the model without compiling it and "
                "pass compile=True: attach(model, compile=True) compiles each block with its mode switch inside."
            )
    refuse_own_checkpointing(model)
    return model
