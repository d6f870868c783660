"""Every relative link in README.md and docs/*.md leads somewhere: the file (or directory) exists,
and a ``#anchor`` names a heading of that file as GitHub makes its anchors."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text: markdown links and emphasis reduced to their text,
    lower case, every character but letters, digits, ``_``, ``-`` and spaces dropped, spaces
    made ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings (a repeated one gets ``-1``, ``-2``, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", path.read_text())):
        a = anchor(m.group(1))
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that lead nowhere, each with the reason."""
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file {dest}")
        elif fragment and dest.suffix == ".md" and unquote(fragment) not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{fragment} in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    assert broken_links(page) == []


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A `code` heading: with [a link](x.md)\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-code-heading-with-a-link) [ok](there.md#twice-1) [ok](#own)\n"
        "[gone](missing.md) [bad anchor](there.md#nowhere) [ok](https://example.com/x.md)\n"
        "`[in code](not-a-link.md)`\n\n```\n[in a block](nor-this.md)\n```\n\n## Own\n"
    )
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "there.md#nowhere"]


def test_anchors_follow_githubs_rule() -> None:
    assert anchor("What `--log-stats` and `sync_interval` cost") == "what---log-stats-and-sync_interval-cost"
    assert anchor("Finding the local stack: `stack.json`") == "finding-the-local-stack-stackjson"
    assert anchor("The engines' wait and the bench") == "the-engines-wait-and-the-bench"
