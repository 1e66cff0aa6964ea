"""CPU shim for SGLang's venv (`make sglang-check` copies it into the venv's
site-packages; Python imports ``sitecustomize`` at start-up).

PyPI's torchvision wheel is built against a CUDA torch: on the CPU torch its
compiled ops do not load, and its ``_meta_registrations`` then fails to
register fakes for ``torchvision::nms`` and ``torchvision::qnms``. SGLang
imports torchvision (through transformers) though a text model never calls
it. Defining those two op schemas just before torchvision is first imported
lets the import succeed; calling them would still fail, which is what we want.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType


class _DefineTorchvisionOps(importlib.abc.MetaPathFinder):
    """Finds nothing: on torchvision's first import it defines the schemas,
    then lets the normal finders load torchvision."""

    def __init__(self) -> None:
        self.library: object = None  # the torch.library fragment, kept alive

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchvision" or self.library is not None:
            return None
        import torch

        library = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            # RuntimeError: already defined (a working torchvision build)
            with contextlib.suppress(RuntimeError):
                library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        self.library = library
        return None


sys.meta_path.insert(0, _DefineTorchvisionOps())
