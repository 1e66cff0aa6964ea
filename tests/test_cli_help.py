"""``ppsync --help`` and every subcommand's: each option says its default,
the timeout default is SyncConfig's, and no reStructuredText is printed."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from ppsync.cli.parser import _parser
from ppsync.schemas.config import DEFAULT_TIMEOUT_S, SyncConfig


def _parsers(p: argparse.ArgumentParser, name: str = "ppsync"
             ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _parsers(child, f"{name} {sub}")


def test_every_option_of_every_subcommand_shows_its_default() -> None:
    missing = []
    for name, p in _parsers(_parser()):
        fmt = p._get_formatter()
        for action in p._actions:
            if (not action.option_strings or action.required or action.default is False
                    or action.default == argparse.SUPPRESS):
                continue
            text = fmt._expand_help(action) if action.help else ""
            if "default" not in text:
                missing.append(f"{name} {action.option_strings[0]}")
    assert missing == []


def test_timeout_default_is_sync_configs() -> None:
    assert SyncConfig.build(pp_size=2, max_num_reqs=1).timeout_s == DEFAULT_TIMEOUT_S
    for name, p in _parsers(_parser()):
        if name in ("ppsync launch", "ppsync run", "ppsync bench"):
            assert p.get_default("timeout") == DEFAULT_TIMEOUT_S, name


def test_help_prints_no_markup() -> None:
    for name, p in _parsers(_parser()):
        text = p.format_help()
        assert "``" not in text and ":func:" not in text and ":class:" not in text, name


def test_run_device_choices_are_the_platform_tables() -> None:
    """``run --device`` offers the platforms ppsync.core.wire.platform knows (the
    parser keeps its own copy so that parsing imports no torch)."""
    from ppsync.cli.parser import DEVICES
    from ppsync.core.wire.platform import PLATFORMS

    assert DEVICES == PLATFORMS
