"""The documentation stays a reference: pages of bounded size whose links resolve.

- No page of ``docs/`` is over :data:`MAX_PAGE_BYTES`.
- Every relative markdown link of the project's markdown files (the README, the
  changelog, ``docs/``, ``deploy/``) names a file that exists, and where it ends in
  ``#anchor`` on a markdown file, that anchor is one of the file's headings as GitHub
  names them (:func:`heading_anchors`).

Fenced code blocks and inline code are not markdown to GitHub, so their ``#`` lines and
bracketed text are neither headings nor links here.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MAX_PAGE_BYTES = 40 * 1024

PAGES = sorted(DOCS.glob("*.md"))
MARKDOWN = [*sorted(ROOT.glob("*.md")), *PAGES, *sorted((ROOT / "deploy").rglob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE_OR_LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
HTML_TAG = re.compile(r"<[^>]+>")
NOT_IN_ANCHOR = re.compile(r"[^\w\- ]")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The file's lines outside fenced code blocks, as (1-based line number, text)."""
    lines: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        opening = FENCE.match(line)
        if fence is not None:
            if opening and opening.group(1) == fence:
                fence = None
            continue
        if opening:
            fence = opening.group(1)
            continue
        lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text lower-cased, everything
    but letters, digits, ``_``, ``-`` and spaces dropped, each space a ``-``."""
    text = INLINE_CODE.sub(lambda match: match.group(2), heading)
    text = IMAGE_OR_LINK_TEXT.sub(lambda match: match.group(1), text)
    text = HTML_TAG.sub("", text).replace("&nbsp;", " ")
    return NOT_IN_ANCHOR.sub("", text.strip().lower()).replace(" ", "-")


def heading_anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the file's headings (a repeated one as ``-1``, ``-2``...)."""
    seen: Counter[str] = Counter()
    anchors: set[str] = set()
    for _, line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        anchors.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return anchors


def paragraphs(path: Path) -> list[tuple[int, str]]:
    """Runs of consecutive prose lines (a link's text may span lines), as (first line
    number, the lines joined by newlines)."""
    runs: list[tuple[int, list[str]]] = []
    last_text = -1  # line number of the last non-blank prose line
    for number, line in prose_lines(path):
        if not line.strip():
            continue
        if runs and number == last_text + 1:
            runs[-1][1].append(line)
        else:
            runs.append((number, [line]))
        last_text = number
    return [(first, "\n".join(lines)) for first, lines in runs]


def relative_links(path: Path) -> list[tuple[int, str]]:
    """The file's relative link targets, as (line number of the target, target)."""
    links: list[tuple[int, str]] = []
    for first, text in paragraphs(path):
        # Inline code blanked out, same length, so that offsets still give line numbers.
        prose = INLINE_CODE.sub(lambda match: " " * len(match.group(0)), text)
        for match in LINK.finditer(prose):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue  # http:, https:, mailto: ...
            links.append((first + prose.count("\n", 0, match.start(1)), target))
    return links


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the file's relative links, one line each, named relative to
    ``root`` (empty when nothing is)."""
    problems: list[str] = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not linked.exists():
            problems.append(f"{where}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            problems.append(f"{where}: no heading with that anchor")
    return problems


def test_the_pages_and_links_are_found() -> None:
    assert len(PAGES) >= 10
    assert (DOCS / "benchmarks.md") in PAGES
    assert any("benchmarks.md#" in target for _, target in relative_links(ROOT / "README.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_no_page_is_over_the_size_limit(page: Path) -> None:
    size = page.stat().st_size
    assert size <= MAX_PAGE_BYTES, f"{page.name} is {size:,} bytes (limit {MAX_PAGE_BYTES:,})"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_anchors_follow_githubs_rules() -> None:
    assert slug("Engine top-k at V = 151,936: what auto picks") == (
        "engine-top-k-at-v--151936-what-auto-picks"
    )
    assert slug("Fused lm_head (`lm_head_topk_kl_loss`)") == "fused-lm_head-lm_head_topk_kl_loss"
    assert slug("Throughput and payload size against vLLM's OpenAI server") == (
        "throughput-and-payload-size-against-vllms-openai-server"
    )
    assert slug("Teacher temperature: accuracy") == "teacher-temperature-accuracy"


def test_a_missing_anchor_or_file_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## A section\n\n## A section\n\n"
        "[ok](#a-section) [twice](#a-section-1) [gone](#no-such) [file](missing.md)\n"
        "```\n[in code](#not-checked)\n# not a heading\n```\n`[inline](#not-checked)`\n"
        "[a link whose text\nspans two lines](#nowhere)\n",
        encoding="utf-8",
    )
    assert heading_anchors(page) == {"title", "a-section", "a-section-1"}
    assert broken_links(page, root=tmp_path) == [
        "page.md:7: #no-such: no heading with that anchor",
        "page.md:7: missing.md: no such file",
        "page.md:14: #nowhere: no heading with that anchor",
    ]
