"""Which module ``attach`` works on: DDP's and DeepSpeed's inner module, an FSDP2 model as it is; compiled, FSDP1 and
DeepSpeed pipeline models refused."""

from __future__ import annotations

from torch import nn

from rematd.client.deepspeed import is_engine, refuse_unsupported
from rematd.client.errors import UnsupportedModel
from rematd.client.refusals import refuse_own_checkpointing
from rematd.client.sharding import refuse_fsdp1


def _compiled(m: nn.Module) -> bool:
    # torch.compile(m) wraps it (an OptimizedModule holding _orig_mod); m.compile() compiles in place,
    # leaving the compiled call in _compiled_call_impl.
    return (
        type(m).__name__ == "OptimizedModule"
        or hasattr(m, "_orig_mod")
        or (getattr(m, "_compiled_call_impl", None) is not None)
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The module to attach to; raises :class:`UnsupportedModel` for a model rematd cannot switch."""
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
    refuse_fsdp1(model)
    refuse_own_checkpointing(model)
    refuse_unsupported(model)
    if isinstance(model, nn.parallel.DistributedDataParallel) or is_engine(model):
        inner = model.module
        assert isinstance(inner, nn.Module)
        return inner
    return model
