"""Every metric the gateway exports is named in docs/operations.md, and every metric the
page names exists: an operator builds alerts from that list (a name renamed in one place
only is an alert that never fires)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def exported() -> set[str]:
    names = set()
    for f in sorted((ROOT / "gateway").rglob("*.py")):
        names |= set(re.findall(r'"(gateway_[a-z0-9_]+)"', f.read_text()))
    return names


def documented() -> set[str]:
    return set(re.findall(r"`(gateway_[a-z0-9_]+)", (ROOT / "docs/operations.md").read_text()))


def test_every_exported_metric_is_documented() -> None:
    doc = documented()
    missing = sorted(n for n in exported() if n not in doc and f"{n}_total" not in doc)
    assert not missing, f"not in docs/operations.md: {missing}"


def test_every_documented_metric_is_exported() -> None:
    names = exported()
    stale = sorted(n for n in documented()
                   if n not in names and n.removesuffix("_total") not in names)
    assert not stale, f"docs/operations.md names metrics the gateway does not export: {stale}"
