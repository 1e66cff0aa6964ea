"""The torch range: declared once in pyproject.toml, the same as
ppsync.core.wire.torch_support says, and an older torch refused with one line."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import torch

from ppsync.core.wire.torch_support import (
    TORCH_NEWEST,
    TORCH_OLDEST,
    require_supported_torch,
    torch_release,
)

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def test_pyproject_declares_the_range_torch_support_checks() -> None:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(r"torch\b", d)]
    oldest, below = TORCH_OLDEST, (TORCH_NEWEST[0], TORCH_NEWEST[1] + 1)
    assert spec == f"torch>={oldest[0]}.{oldest[1]},<{below[0]}.{below[1]}", spec


def test_this_torch_is_in_the_range() -> None:
    assert TORCH_OLDEST <= torch_release(str(torch.__version__)) <= TORCH_NEWEST


@pytest.mark.parametrize(("version", "release"), [
    ("2.11.0", (2, 11)), ("2.11.0+cu130", (2, 11)), ("2.11.0a0+gitabc", (2, 11)),
    ("2.14.1", (2, 14)), ("10.2.3+cpu", (10, 2)),
])
def test_a_version_reads_as_its_release(version: str, release: tuple[int, int]) -> None:
    assert torch_release(version) == release
    require_supported_torch(version)  # each of these is supported (or newer)


@pytest.mark.parametrize("version", ["2.10.1+cu128", "2.4.0", "1.13.1"])
def test_an_older_torch_is_refused_naming_it_and_the_range(version: str) -> None:
    with pytest.raises(ImportError, match=rf"ppsync needs torch >= 2\.11 \(supported: 2\.11 "
                                          rf"to 2\.14.*\); this is torch {re.escape(version)}"):
        require_supported_torch(version)
