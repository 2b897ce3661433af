"""Every option of every `gateway` command is named in the operator's docs (the command
tables of docs/operations.md and docs/contracts.md, or the README), by its long or its
short form: a flag added to the parser only is a flag nobody finds."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

from gateway.cli import parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = "\n".join((ROOT / f).read_text() for f in ("docs/operations.md", "docs/contracts.md",
                                                   "README.md"))


def options(p: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, list[str]]]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in sorted(action.choices.items()):
                yield from options(sub, f"{path} {name}")
        elif action.option_strings and "--help" not in action.option_strings:
            yield path, action.option_strings


def named(flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", DOCS) is not None


def test_every_command_option_is_documented() -> None:
    found = list(options(parser(), "gateway"))
    assert len(found) > 50  # the walk reached the subcommands
    missing = [f"{cmd} {'/'.join(flags)}" for cmd, flags in found
               if not any(named(f) for f in flags)]
    assert not missing, f"options no doc names: {missing}"
