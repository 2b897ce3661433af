"""Every relative link in the README and docs/ names a file of the repository, and every
`#anchor` a heading of its file (GitHub's slugs): a clone has no other copy of the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "benchmarks" / "README.md", ROOT / "deploy" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slugs(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, and a
    repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1).strip())
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


def test_the_slug_rule() -> None:
    assert re.sub(r"[^\w\- ]", "", "issue 26's targets").replace(" ", "-") == \
        "issue-26s-targets"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def test_the_readmes_policy_example_is_a_valid_policy() -> None:
    """The README's Policy document validates as printed (it once carried an elided
    `sha256: "9f86d0818…"`, which `policy apply` refuses), so a reader can paste it."""
    from gateway.policy.loader import parse_doc
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Policy\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```yaml\n(.*?)^```", section, re.S | re.M)
    assert block, "no yaml block under ## Policy"
    doc = parse_doc(block.group(1), "README.md ## Policy")
    assert doc.keys and doc.models and doc.teams


@pytest.mark.parametrize("doc", ["README.md", "docs/contracts.md"])
def test_every_setting_is_in_the_settings_table(doc: str) -> None:
    """The README's Configuration table and contracts §7 name every `GATEWAY_*` setting
    (contracts once lacked GATEWAY_SPOOL_ALERT_S)."""
    from gateway.settings import Settings
    rows = set(re.findall(r"^\| `(GATEWAY_\w+)` \|", (ROOT / doc).read_text(), re.M))
    missing = {f"GATEWAY_{f.upper()}" for f in Settings.model_fields} - rows
    assert not missing, sorted(missing)


def test_the_contracts_policy_example_is_a_valid_policy() -> None:
    """contracts.md §2's example document validates as printed, as the README's does (it
    too carried the elided `sha256: "9f86d081…"`, which `policy apply` refuses)."""
    from gateway.policy.loader import parse_doc
    text = (ROOT / "docs" / "contracts.md").read_text()
    section = text.split("\n## 2. Policy document\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```yaml\n(.*?)^```", section, re.S | re.M)
    assert block, "no yaml block under ## 2. Policy document"
    doc = parse_doc(block.group(1), "docs/contracts.md §2")
    assert doc.keys and doc.models and doc.teams and doc.passthrough
