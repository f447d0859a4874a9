"""The suite's hypothesis profile: derandomized in ``make test``, and no test overrides it
with settings of its own that would draw other examples on another run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis_profiles import DERANDOMIZED, FUZZ, FUZZ_FACTOR, active_profile, examples

TESTS = Path(__file__).resolve().parent
# A test's own randomizing settings: derandomize, a fixed seed that changes per edit, or
# a literal example budget (the fuzz profile could not widen it).
OVERRIDES = re.compile(r"derandomize\s*=|@seed\(|max_examples\s*=\s*\d|database\s*=")


def test_the_active_profile_is_loaded() -> None:
    profile = active_profile()
    assert settings.default.deadline is None and settings.default.print_blob
    assert settings.default.derandomize is (profile == DERANDOMIZED)
    assert examples(7) == (7 * FUZZ_FACTOR if profile == FUZZ else 7)


def test_no_test_overrides_the_profile() -> None:
    offenders = [
        f"{path.relative_to(TESTS)}:{number}: {line.strip()}"
        for path in sorted(TESTS.rglob("*.py"))
        if path.name != "hypothesis_profiles.py" and path != Path(__file__).resolve()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if OVERRIDES.search(line)
    ]
    assert not offenders, "\n".join(offenders)


def test_an_unknown_profile_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "wide")
    with pytest.raises(ValueError, match="HYPOTHESIS_PROFILE='wide'"):
        active_profile()
