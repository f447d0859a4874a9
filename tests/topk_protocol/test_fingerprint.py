"""The answer-fingerprint rules: canaries, comparison within the stated drift, files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from topk_protocol import pb
from topk_protocol.fingerprint import (
    AnswerFingerprint,
    FingerprintFileError,
    answer_problems,
    canary_sequences,
    differences,
    load_fingerprint,
    stated_drift,
)
from topk_protocol.info import TeacherInfo


def _fingerprint(seed: int = 0, *, dtype: str = "float32", p: int = 64, k: int = 8):
    rng = np.random.default_rng(seed)
    # Rows descending, neighbours at least 0.05 apart: every rank unambiguous at 1e-3.
    steps = rng.uniform(0.05, 0.5, size=(p, k))
    logprobs = (-np.cumsum(steps, axis=1)).astype(np.float32)
    ids = np.stack([rng.permutation(512)[:k] for _ in range(p)]).astype(np.int32)
    return AnswerFingerprint("v1:1x64", ids, logprobs, stated_drift(dtype), dtype, "tiny")


def test_canaries_are_a_fixed_function_of_vocab_and_shape() -> None:
    a = canary_sequences(512)
    assert [s.shape for s in a] == [(64,)] * 4
    assert all(s.dtype == np.int32 and s.min() >= 0 and s.max() < 512 for s in a)
    # Written down once: a change of the canaries changes every fingerprint.
    assert a[0][:6].tolist() == [431, 193, 206, 493, 202, 346]
    assert [s.tolist() for s in canary_sequences(512)] == [s.tolist() for s in a]
    assert not np.array_equal(a[0], a[1])
    with pytest.raises(ValueError, match="vocab_size"):
        canary_sequences(0)


def test_same_answers_within_drift_agree_even_where_close_entries_swap() -> None:
    fp = _fingerprint()
    noise = np.random.default_rng(1).uniform(-9e-4, 9e-4, size=fp.logprobs.shape)
    ids = fp.ids.copy()
    lps = fp.logprobs.copy()
    # Two entries 1e-4 apart may swap by rounding alone: not a difference.
    lps[3, 5] = lps[3, 4] - 1e-4
    ids[3, [4, 5]] = ids[3, [5, 4]]
    fp_close = AnswerFingerprint(fp.canary, fp.ids, lps, fp.drift, "float32", "tiny")
    swapped = AnswerFingerprint(fp.canary, ids, (lps + noise).astype(np.float32), 1e-3, "float32")
    assert differences(swapped, fp_close) == []
    assert differences(fp, fp) == []


def test_other_values_ids_dtype_or_canaries_differ_by_name() -> None:
    fp = _fingerprint()
    shifted = AnswerFingerprint(fp.canary, fp.ids, fp.logprobs + 0.01, fp.drift, "float32")
    (problem,) = differences(shifted, fp)
    assert problem.startswith("log-probs: differ by up to 0.01 (drift 0.001) at 64 of 64")
    ids = fp.ids.copy()
    ids[10, 0] += 1
    (problem,) = differences(AnswerFingerprint(fp.canary, ids, fp.logprobs, 1e-3, "float32"), fp)
    assert problem == (
        "top ids: differ at 1 of 448 unambiguous ranks (1 canary positions, first at position 10)"
    )
    half = AnswerFingerprint(fp.canary, fp.ids, fp.logprobs, stated_drift("bfloat16"), "bfloat16")
    assert differences(half, fp) == ["engine dtype: bfloat16, the reference float32"]
    other = AnswerFingerprint("v1:4x64", fp.ids, fp.logprobs, 1e-3, "float32")
    assert "not comparable" in differences(other, fp)[0]


def test_message_and_json_round_trip(tmp_path: Path) -> None:
    fp = _fingerprint()
    back = AnswerFingerprint.from_message(fp.to_message())
    assert np.array_equal(back.ids, fp.ids) and np.array_equal(back.logprobs, fp.logprobs)
    assert (back.canary, back.drift, back.engine_dtype, back.model_name) == (
        fp.canary,
        fp.drift,
        "float32",
        "tiny",
    )
    # The three files --expect-fingerprint reads: the fingerprint, /v1/info, a recording.
    (tmp_path / "fp.json").write_text(fp.to_json())
    info = pb.TeacherInfo(model_name="tiny", answer_fingerprint=fp.to_message())
    from google.protobuf import json_format

    info_json = json_format.MessageToDict(info, preserving_proto_field_name=True)
    (tmp_path / "info.json").write_text(json.dumps(info_json))
    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / "metadata.json").write_text(json.dumps({"teacher": info_json}))
    for name in ("fp.json", "info.json", "rec"):
        assert differences(load_fingerprint(tmp_path / name), fp) == []
    assert TeacherInfo.from_message(info).answer_fingerprint is not None
    assert TeacherInfo.from_message(pb.TeacherInfo()).answer_fingerprint is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read it"),
        ("{not json", "not JSON"),
        ('{"model_name": "tiny"}', "holds no answer fingerprint"),
        ('{"ids": "AAAA", "logprobs": "AAAA", "top_k": 2}', "answer_fingerprint.ids: 3 bytes"),
        ('{"ids": "", "logprobs": "", "top_k": 1}', "answer_fingerprint: no canary positions"),
    ],
)
def test_a_file_that_does_not_parse_is_named(tmp_path: Path, content: str | None, message: str):
    path = tmp_path / "ref.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(FingerprintFileError, match=message) as e:
        load_fingerprint(path)
    assert str(path) in str(e.value)


def test_answer_problems_of_two_infos() -> None:
    a, b = _fingerprint(0), _fingerprint(1)
    mine = pb.TeacherInfo(answer_fingerprint=a.to_message())
    assert answer_problems(mine, pb.TeacherInfo(answer_fingerprint=a.to_message())) == []
    assert answer_problems(mine, pb.TeacherInfo()) == []  # an older teacher: not judged
    (problem,) = answer_problems(mine, pb.TeacherInfo(answer_fingerprint=b.to_message()))
    assert problem.startswith("answer_fingerprint: this teacher (model 'tiny', dtype float32)")
