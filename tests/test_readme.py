"""The README a newcomer reads in one sitting: short enough (about 150 lines), and every relative link in it
and in docs/*.md and bench/RESULTS.md resolves, to a file that exists and, after a `#`, to a heading of that
file as GitHub names its anchors. The tables it holds are checked by tests/test_bench.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "RESULTS.md"]


def _prose(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with their numbers."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file: lower case, punctuation dropped, spaces to
    hyphens, a repeated one numbered -1, -2, ..."""
    found: set[str] = set()
    for _, line in _prose(path.read_text()):
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n, candidate = 0, slug
            while candidate in found:
                n += 1
                candidate = f"{slug}-{n}"
            found.add(candidate)
    return found


def broken_links(path: Path) -> list[str]:
    """Each relative link of `path` whose file or anchor does not exist, with its line number."""
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    broken = []
    for number, line in _prose(path.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...: not ours to resolve offline
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                broken.append(f"{shown}:{number}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{shown}:{number}: {target} (no heading with that anchor)")
    return broken


def test_the_anchor_rule_is_githubs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# The zoom demo: thinking with images (`configs/demo_zoom.yaml`)\n## Status\n## Status\n"
                    "```\n# not a heading\n```\n[ok](#status-1) [bad](#not-a-heading) [gone](missing.md)\n")
    assert anchors(page) == {"the-zoom-demo-thinking-with-images-configsdemo_zoomyaml", "status", "status-1"}
    assert broken_links(page) == ["page.md:7: #not-a-heading (no heading with that anchor)",
                                  "page.md:7: missing.md (no such file)"]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(document):
    assert not broken_links(document), "\n".join(broken_links(document))


def test_the_readme_is_read_in_one_sitting():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move detail to docs/ and link it")
    text = "\n".join(lines)
    for marker in ("<!-- demo-table:start -->", "<!-- demo-table:end -->", "<!-- zoom-table:start -->",
                   "<!-- zoom-table:end -->"):
        assert text.count(marker) == 1, marker
