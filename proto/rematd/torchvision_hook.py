"""torchvision beside a torch it was not built for: import it anyway, with its compiled ops left out.

PyPI's torchvision wheels link against torch's CUDA build. Next to torch's CPU build their ops library
does not load, and ``import torchvision`` then fails registering fake kernels for ``nms`` and ``qnms``
(``RuntimeError: operator torchvision::nms does not exist``); so do ``timm`` and the parts of
``transformers`` that reach for it. Models need none of those ops (they are detection's). Once
:func:`install` has run, an import of torchvision that fails this way declares the two schemas and runs
again; an import that works is left alone, and no other error is hidden. Standard library only: a
``.pth`` file runs :func:`install` at every start of Python (``python -m rematd.torchvision_ops``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

_OPS = ("nms", "qnms")
_LIBS: list[object] = []


def _declare_ops() -> None:
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in _OPS:
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBS.append(lib)  # the schemas live as long as the library object


class _Loader(importlib.abc.Loader):
    """torchvision's own loader; when its ops cannot load, the schemas declared and the import run again."""

    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self.real.exec_module(module)
        except RuntimeError as err:
            if "torchvision::" not in str(err) or _LIBS:
                raise
            for name in [m for m in sys.modules if m.startswith("torchvision.")]:
                del sys.modules[name]
            _declare_ops()
            self.real.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torchvision":
            return None
        # The spec of the finders after this one (a package's availability check asks too: every spec
        # handed out carries the loader, for whichever is used to import).
        for finder in sys.meta_path:
            if isinstance(finder, _Finder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Apply the fix to this process's next ``import torchvision`` (nothing is imported now)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
