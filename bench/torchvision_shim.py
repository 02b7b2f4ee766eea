"""Import torchvision (timm and transformers reach for it) even where its compiled ops cannot load.

PyPI's torchvision wheels link against torch's CUDA libraries, so next to torch's CPU build their ops
library does not load, and torchvision's import then fails registering fake kernels for ``nms`` and
``qnms``. The models here need none of those ops: declare the two schemas and import again.
"""

from __future__ import annotations

import sys

_LIBS: list[object] = []


def import_torchvision() -> None:
    try:
        import torchvision  # type: ignore[import-untyped]
    except ImportError:
        return
    except RuntimeError as err:
        if "torchvision::" not in str(err):
            raise
        import torch

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIBS.append(lib)  # the schemas live as long as the library object
        import torchvision  # noqa: F401
