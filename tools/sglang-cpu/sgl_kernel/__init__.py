"""Stand-in for ``sgl_kernel`` in SGLang's CPU venv (`make sglang-check`
puts this package in the place of the installed one).

The ``sgl-kernel`` build on PyPI is for CUDA, and SGLang's CPU build of it
needs AVX-512/AMX. With the torch-native attention and PyTorch sampling
backends and CUDA graphs off, SGLang's CPU path imports names from it but
calls none of them for a small Llama. Every name resolves to a placeholder
that raises, naming the op, if it is ever called: a missing kernel is an
error, never a silent wrong answer.
"""

from __future__ import annotations

import sys

__version__ = "0.0.0+ppsync-cpu-stub"


class _Missing:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> object:
        print(f"sgl_kernel stand-in: {self._name} was called", file=sys.stderr, flush=True)
        raise NotImplementedError(f"sgl_kernel stand-in: {self._name} has no CPU kernel here")

    def __getattr__(self, name: str) -> _Missing:
        return _Missing(f"{self._name}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._name}>"


def __getattr__(name: str) -> _Missing:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name)
