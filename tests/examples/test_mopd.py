"""examples/mopd.py, short: two teachers pretrained (briefly) on two corpora, served by
the transformers backend, one routed student and the two single-teacher baselines on the
same batches; the per-domain table, every KL finite, and the routed student close to the
matching single-teacher student on each domain (the full run's 10% is in the README)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from examples import mopd

ARGS = [
    "--backend", "transformers", "--steps", "12", "--batch-size", "4", "--seq-len", "64",
    "--eval-windows", "4", "--teacher-steps", "30", "--teacher-batch-size", "4",
    "--teacher-seq-len", "64", "--depth", "2", "--corpus-max-bytes", "1000000",
    "--eval-every", "6",
]  # fmt: skip


def test_mopd_short_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = mopd.main([*ARGS, "--cache-dir", str(tmp_path / "cache"), "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| routed |" in printed and "| code only |" in printed and "| docs only |" in printed
    saved = json.loads((out / "result.json").read_text())
    heldout = saved["result"]["heldout"]
    assert set(heldout) == set(mopd.STUDENTS)
    for student in mopd.STUDENTS:
        assert set(heldout[student]) == set(mopd.DOMAINS)
        assert all(math.isfinite(r["kl_teacher_student"]) for r in heldout[student].values())
        assert len(saved["result"]["train_loss"][student]) == 12
    assert set(saved["result"]["teachers"]) == {"code", "docs"}
    # Held-out checkpoints every 6 steps, the last one the final evaluation.
    for student in mopd.STUDENTS:
        curve = saved["result"]["curve"][student]
        assert [step for step, _ in curve] == [6, 12]
        final = {d: r["kl_teacher_student"] for d, r in heldout[student].items()}
        assert curve[-1][1] == pytest.approx(final)
    assert [step for step, _ in saved["curve_gaps"]] == [6, 12]
    assert [step for step, _ in saved["curve_gaps_half"]] == [6, 12]
    assert set(saved["gaps_half"]) == set(mopd.DOMAINS)
    assert "  at step 6: code " in printed
    assert "(<domain> only)" in printed and "(<domain> half)" in printed
    # The teachers differ, so each is some way from their mixture (and at most log 2 away).
    mixture = saved["result"]["mixture_kl"]
    assert all(0.0 < mixture[d] < math.log(2) for d in mopd.DOMAINS), mixture
    assert "| (50/50 mixture of the teachers) |" in printed
    # Twelve steps: the students have barely moved, but the routed one is not far off.
    assert all(abs(g) < 0.25 for g in saved["gaps"].values()), saved["gaps"]
    # The teachers are cached: a second build reuses them.
    cached = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert cached == ["mopd-code-30x4x64-1000000b", "mopd-docs-30x4x64-1000000b"]


def test_config_errors_name_the_field() -> None:
    with pytest.raises(SystemExit, match="batch_size: must be even"):
        mopd.main(["--batch-size", "3"])
    with pytest.raises(SystemExit, match="eval_every: must be >= 0"):
        mopd.main(["--eval-every", "-1"])
    with pytest.raises(SystemExit, match="hidden_size: must be even"):
        mopd.main(["--hidden-size", "63"])
    assert mopd.routing("routed", 4) == ["code", "code", "docs", "docs"]
    assert mopd.routing("docs only", 2) == ["docs", "docs"]
    # The "half" baselines train on their own domain's rows only, scored by its teacher.
    assert mopd.rows("routed", 6) == slice(0, 6) and mopd.rows("code only", 6) == slice(0, 6)
    assert mopd.rows("code half", 6) == slice(0, 3) and mopd.rows("docs half", 6) == slice(3, 6)
    assert mopd.routing("docs half", 6) == ["docs"] * 3
