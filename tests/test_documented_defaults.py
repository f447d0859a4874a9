"""The defaults the README and ``docs/`` state for the tools' flags are the ones their
``--help`` prints (``teacher-server serve`` and ``teacher-record``), and ``serve --help``
lists the project's own flags before the engine's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from student_client.offline.record_cli import build_parser as record_parser
from teacher_server import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# "`--flag` ... (default 4" / ", default 10" / "the default 1024": a flag's stated default.
DOC_DEFAULT = re.compile(
    r"`(--[a-z][a-z0-9-]*)`[^`]{0,60}?(?:\(|, |the )default:?\s+(`?)([$\w.\-]+)\2"
)
HELP_ENTRY = re.compile(r"^  (--[a-z][a-z0-9-]*)", re.M)
HELP_DEFAULT = re.compile(r"\(default: ([^)]*)\)|; default: ([^)]*)\)")


def _serve_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--help"])
    return capsys.readouterr().out


def _defaults(help_text: str) -> dict[str, str]:
    """``--flag -> the default its help entry prints`` (entries that print one)."""
    out: dict[str, str] = {}
    starts = [(m.start(), m.group(1)) for m in HELP_ENTRY.finditer(help_text)]
    for (start, flag), (end, _) in zip(starts, [*starts[1:], (len(help_text), "")], strict=True):
        entry = " ".join(help_text[start:end].split())
        found = HELP_DEFAULT.search(entry)
        if found:
            out.setdefault(flag, (found.group(1) or found.group(2)).strip())
    return out


def _same(doc: str, helped: str) -> bool:
    try:
        return float(doc) == float(helped)
    except ValueError:
        return doc == helped


def test_documented_defaults_match_help(capsys: pytest.CaptureFixture[str]) -> None:
    helped = {**_defaults(record_parser().format_help()), **_defaults(_serve_help(capsys))}
    stated = [
        (path.relative_to(ROOT), m.group(1), m.group(3))
        for path in DOCS
        for m in DOC_DEFAULT.finditer(" ".join(path.read_text().split()))
        if m.group(1) in helped
    ]
    assert len(stated) >= 8, stated  # the check reads the docs' statements at all
    wrong = [
        f"{path}: {flag} default {doc}, --help says {helped[flag]}"
        for path, flag, doc in stated
        if not _same(doc, helped[flag])
    ]
    assert not wrong, "\n".join(wrong)


def test_serve_help_lists_the_project_flags_first(capsys: pytest.CaptureFixture[str]) -> None:
    text = _serve_help(capsys)
    flags = [m.group(1) for m in HELP_ENTRY.finditer(text)]
    own = ["--backend", "--token-file", "--log-level", "--host", "--max-top-k", "--model"]
    engine = ["--max-num-seqs", "--gpu-memory-utilization", "--enforce-eager"]
    last_own = max(flags.index(f) for f in own)
    assert all(flags.index(f) > last_own for f in engine), flags[: last_own + 1]
    assert flags.index("--backend") < 3 and flags.index("--token-file") < 3
    # One default per entry, none for an absent one, and no flag repeated in its help.
    assert not re.search(r"\(default: [^)]*\)\s*\(default:", text)
    assert "(default: None)" not in text
    assert "--no-warmup (--no-warmup)" not in " ".join(text.split())
    assert text.count("\n  --model ") == 1 and text.count("\n  --served-model-name") == 1


def test_record_help_names_every_default_and_refers_to_nothing_missing() -> None:
    text = " ".join(record_parser().format_help().split())
    assert "(see above)" not in text
    helped = _defaults(record_parser().format_help())
    for flag, value in {
        "--batch-size": "8",
        "--depth": "4",
        "--compression": "zstd",
        "--split": "train",
        "--teacher-column": "teacher_id",
        "--top-k": "16",
    }.items():
        assert helped.get(flag) == value, (flag, helped.get(flag))
    assert "print every problem" in text and "count" in text
