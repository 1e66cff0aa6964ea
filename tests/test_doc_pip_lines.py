"""The README's ``pip install`` lines install ppsync from a clone as written.

Each line runs, with pip, in a copy of this repository (what a clone holds,
as a reader's checkout does) from its root, into a throwaway venv that sees
this environment's packages (torch and the rest are not downloaded again:
``--no-deps``, and ``--no-build-isolation`` where setuptools is here); then
that venv imports ppsync from what the line installed and finds both
engines' plugin entry points. A line that names a path the clone does not
have (``pip install ./ppsync``) fails.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from test_doc_commands import candidates

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
_NOT_IN_A_CLONE = shutil.ignore_patterns(
    ".git", ".venv*", "__pycache__", "*.egg-info", "build", "dist", ".*_cache",
    ".hypothesis", "wheels", "sglang-check-work")
CHECK = """
import importlib.metadata as md, pathlib, sys, ppsync
where = pathlib.Path(ppsync.__file__).resolve()
assert pathlib.Path(sys.prefix).resolve() in where.parents, where
for group in ("vllm.general_plugins", "sglang.srt.plugins"):
    assert "ppsync" in [e.name for e in md.entry_points(group=group)], group
print("ok", where)
"""


def pip_lines(text: str) -> list[str]:
    """The distinct ``pip install`` lines of ``text``'s shell blocks, without
    their comments."""
    lines = [cmd.split(" # ")[0].strip() for _, cmd in candidates(text)]
    return list(dict.fromkeys(c for c in lines if re.match(r"pip install\s", c)))


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the repository as a clone holds it (no venvs, caches, builds)."""
    dest = tmp_path_factory.mktemp("clone") / "ppsync-clone"
    shutil.copytree(REPO, dest, ignore=_NOT_IN_A_CLONE)
    return dest


def install(line: str, clone: Path, env_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run ``line`` at the root of ``clone`` with a new venv's pip; the venv
    sees this interpreter's site-packages after its own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)],
                   check=True, timeout=60)
    env_site = next((env_dir / "lib").glob("python3*/site-packages"))
    (env_site / "_outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    words = shlex.split(line)
    assert words[:2] == ["pip", "install"], line
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # The build backend from this environment where it has one; else (no
    # setuptools in a Python 3.12 venv) pip fetches it as `make venv` did.
    local_build = (["--no-build-isolation", "--no-index"]
                   if importlib.util.find_spec("setuptools") is not None else [])
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"),
         "install", "-q", "--no-deps", *local_build, *words[2:]],
        cwd=clone, env=env, capture_output=True, text=True, timeout=240)


def test_the_readme_has_its_install_lines() -> None:
    assert len(pip_lines(README.read_text())) >= 1
    assert pip_lines("```sh\npip install .   # here\nmake test\n```\n") == ["pip install ."]


@pytest.mark.timeout(300)
def test_each_readme_pip_line_installs_ppsync_from_a_clone(clone: Path, tmp_path: Path) -> None:
    for n, line in enumerate(pip_lines(README.read_text())):
        env_dir = tmp_path / f"env{n}"
        done = install(line, clone, env_dir)
        assert done.returncode == 0, f"{line!r} at a clone's root:\n{done.stderr}"
        check = subprocess.run([str(env_dir / "bin" / "python"), "-I", "-c", CHECK],
                               cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert check.returncode == 0, f"{line!r}: ppsync not importable from it:\n{check.stderr}"


@pytest.mark.timeout(120)
def test_a_path_the_clone_lacks_fails(clone: Path, tmp_path: Path) -> None:
    done = install("pip install ./ppsync", clone, tmp_path / "env")
    assert done.returncode != 0
