"""Every command that README.md and docs/*.md tell a reader to type runs as
written: each shell line starting with ``ppsync``, ``make`` or ``torchrun
... -m ppsync`` (in a code block, or an inline code span with a flag) is
parsed by the ``ppsync`` parser (nothing runs), and a make line by ``make
-n`` (the target exists, and every ``ppsync`` line of its recipe parses too).

Placeholders a reader fills in are read as written where they parse, and
else: ``a|b`` is each alternative, ``launch/run`` each subcommand, ``...``
nothing, ``[--flag]`` the flag, ``$VAR`` a number. The README's ``pip
install`` lines are run for real by tests/test_doc_pip_lines.py, and its
torchrun lines of ``examples/embed_anyio.py`` by tests/test_examples.py.

Every module that a ``-m`` names there, in the Makefile or in the package
(a usage line, a child's command) exists: a module that moves takes its
command lines with it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ppsync.cli.parser import parse

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_BIN = re.compile(r"^(?:\$ )?(?:[\w.$()/-]*/bin/)?")
_START = re.compile(r"^(ppsync|make|torchrun)\s")


def candidates(text: str) -> Iterator[tuple[int, str]]:
    """(line number, command) of every shell line and inline span in ``text``."""
    fence: str | None = None
    held = ""  # a code line continued with a backslash
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.strip().removeprefix("```")
            continue
        if fence is not None:
            if fence in ("", "sh", "bash", "console", "shell"):
                held += line.strip()
                if held.endswith("\\"):
                    held = held[:-1] + " "
                    continue
                yield no, held
            held = ""
            continue
        for span in re.findall(r"`([^`]+)`", line):
            # a command line, not the name of a subcommand; every make line
            if " -" in span or span.startswith("make "):
                yield no, span.strip()


def _commands(text: str) -> Iterator[tuple[int, str]]:
    """The commands to check: one per ``&&`` part, without a prompt, the
    variables set before it, a venv's bin/ prefix, a trailing comment or a
    pipe's reader."""
    for no, cand in candidates(text):
        for part in cand.split("&&"):
            part = part.split(" # ")[0].split(" | ")[0].strip()
            part = _BIN.sub("", re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+", "", part))
            if _START.match(part):
                yield no, part


def _expand(words: list[str]) -> Iterator[list[str]]:
    """Every reading of ``words`` with its placeholders filled in."""
    options: list[list[str]] = []
    for w in words:
        if w == "...":
            options.append([])
        elif w.startswith("$"):
            options.append(["2"])
        elif w.startswith("[") or w.endswith("]"):  # optional words: read them
            options.append([w.strip("[]")])
        elif "|" in w and not w.startswith("-"):
            options.append(w.split("|"))
        elif re.fullmatch(r"[a-z]+/[a-z]+", w):
            options.append(w.split("/"))
        else:
            options.append([w])
    for choice in itertools.product(*[o or [""] for o in options]):
        yield [c for c in choice if c]


def check_ppsync(argv: list[str]) -> str | None:
    """None when the ppsync parser takes ``argv``; else its error."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse(argv)
    except SystemExit as e:
        if e.code:
            return err.getvalue().strip() or f"exit {e.code}"
    return None


def check_command(line: str) -> str | None:
    """None when ``line`` (a ppsync, torchrun -m ppsync or make line) is
    one the tools take as written; else what is wrong."""
    try:
        words = shlex.split(line)
    except ValueError as e:
        return f"not a shell line: {e}"
    for argv in _expand(words):
        if argv[0] == "ppsync":
            error = check_ppsync(argv[1:])
        elif argv[0] == "torchrun":
            if "ppsync" not in argv or argv.index("ppsync") < 1 or argv[
                    argv.index("ppsync") - 1] != "-m":
                continue  # torchrun of a script, not of ppsync
            error = check_ppsync(argv[argv.index("ppsync") + 1:])
        else:
            error = _check_make(argv[1:])
        if error is not None:
            return f"{' '.join(argv)}: {error}"
    return None


def _check_make(args: list[str]) -> str | None:
    make = shutil.which("make")
    if make is None:  # pragma: no cover - the image has make
        return None
    done = subprocess.run([make, "-n", "-C", str(REPO), *args], capture_output=True,
                          text=True, timeout=60)
    if done.returncode != 0:
        return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "make -n failed"
    for recipe in done.stdout.replace("\\\n", " ").splitlines():  # its own ppsync lines
        m = re.search(r"(?:^|\s)\S*/bin/ppsync\s(.*)$", recipe)
        if m is not None:
            error = check_ppsync(shlex.split(m.group(1)))
            if error is not None:
                return f"its recipe line {recipe!r}: {error}"
    return None


def _all() -> list[tuple[str, str]]:
    return [(f"{doc.name}:{no}", cmd) for doc in DOCS for no, cmd in _commands(doc.read_text())]


def test_the_docs_hold_commands_to_check() -> None:
    found = _all()
    assert len(found) > 40, found
    assert any("torchrun" in c for _, c in found) and any(c.startswith("make ") for _, c in found)


@pytest.mark.timeout(300)
def test_every_command_in_the_docs_runs_as_written() -> None:
    bad = [f"{where}: {cmd}: {error}" for where, cmd in _all()
           if (error := check_command(cmd)) is not None]
    assert bad == []


@pytest.mark.parametrize("line", [
    "ppsync launch --pp-size 3 --spcc 2",
    "ppsync launch --pp-size 3 --codec devcie",
    "torchrun --nnodes 2 --nproc-per-node 2 -m ppsync run --pp-size 2 --sepc 2",
    "ppsync dump shwo DIR/*.jsonl",
    "make demoo",
])
def test_a_misspelled_command_is_caught(line: str) -> None:
    assert check_command(line) is not None


def test_placeholders_are_each_reading() -> None:
    assert check_command("ppsync dump validate|show|trace DIR/*.jsonl -o t.json") is not None
    assert check_command("ppsync dump show DIR/*.jsonl [--json]") is None
    assert check_command("ppsync bench --pp-size 2 --rows 256 --spec 0|3") is None
    assert check_command("ppsync launch/run --emulate nccl --codec device") is not None


# ``-m ppsync.x.y`` across a line break too, or in a child's argv (``"-m",
# "ppsync.x.y"``): the module a reader, a recipe or a check runs. Lower-case
# parts only, so a placeholder such as ``ppsync.probes.NAME`` is read up to
# its package.
_MODULE = re.compile(r"""-m[\s"',]+(ppsync(?:\.[a-z_][a-z0-9_]*)*)\b""")


def run_modules(text: str) -> set[str]:
    """The modules ``text`` runs with ``python -m``."""
    return set(_MODULE.findall(text))


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a package on the way is gone
        return False


def test_every_module_the_docs_and_the_makefile_run_exists() -> None:
    """A module that moves leaves no ``python -m`` line behind it: in the
    docs, the Makefile, or the package's own usage lines and child commands."""
    sources = [*DOCS, REPO / "Makefile", *sorted((REPO / "ppsync").rglob("*.py"))]
    named = {(src.relative_to(REPO).as_posix(), mod)
             for src in sources for mod in run_modules(src.read_text())}
    assert len(named) > 10, named
    missing = sorted((src, mod) for src, mod in named if not module_exists(mod))
    assert missing == []


def test_a_module_that_is_gone_is_seen() -> None:
    text = ("python -m\n   ppsync.bench.gpu_check; make runs -m ppsync.probes.NAME;\n"
            '[sys.executable, "-m", "ppsync.harness.vllm_check.engine", spec]')
    assert run_modules(text) == {"ppsync.bench.gpu_check", "ppsync.probes",
                                 "ppsync.harness.vllm_check.engine"}
    assert not module_exists("ppsync.bench.gpu_check")
    assert not module_exists("ppsync.harness.vllm_check.engine")
    assert module_exists("ppsync.checks.vllm.engine")
