"""The replay rules, written once in ``topk_protocol.recording.replay`` and used by the
``ReplayClient``, the ``PayloadDataset`` and the replay backend: what a recording can
answer, the message naming what is missing, and the request options a recording is made
at (a new option marked ``RECORDED`` is stored by the recorder and checked by replay with
no other code)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
from recording_fakes import INFO, K, teacher_answer

from topk_protocol import RECORDED, RequestOptions, build_request, encode_sequence, pb
from topk_protocol.errors import NotRecordedError, RecordingError
from topk_protocol.recording import RecordingReader, RecordingWriter
from topk_protocol.recording.replay import (
    check_options,
    describe_sequence,
    find_rows,
    recorded_arrays,
)


@dataclass(frozen=True)
class _WithSoftCap(RequestOptions):
    """RequestOptions with one more option a recording is made at (what adding one to
    ``RequestOptions`` itself would look like)."""

    soft_cap: float = field(default=0.0, metadata=RECORDED)


def _answer(
    tokens: np.ndarray, options: RequestOptions
) -> tuple[pb.ScoreRequest, pb.ScoreResponse]:
    _, scored = teacher_answer(len(tokens), seed=int(tokens[0]))
    req = build_request([tokens], options)
    if not options.include_sampled:
        scored = replace(scored, sampled_logprobs=None)
    payload = encode_sequence(scored, dtype=options.dtype)
    return req, pb.ScoreResponse(final=True, sequences=[payload])


def _recording(path: Path, options: RequestOptions, n: int = 2) -> list[np.ndarray]:
    seqs = [teacher_answer(6 + i, seed=i)[0] for i in range(n)]
    with RecordingWriter(path, INFO) as w:
        for tokens in seqs:
            req, resp = _answer(tokens, options)
            assert w.write(req, resp, options) == 1
    return seqs


def test_what_a_recording_answers_and_the_message_naming_what_not(tmp_path: Path) -> None:
    seqs = _recording(tmp_path / "r", RequestOptions(K, "float16"))
    with RecordingReader(tmp_path / "r") as reader:
        keys = [(s.tobytes(), 1, len(s)) for s in seqs]
        rows = find_rows(reader, keys, RequestOptions(4, "float16"), "rec")
        got = recorded_arrays(rows[0], 1, len(seqs[0]), RequestOptions(4))
        assert got.ids.shape == (len(seqs[0]) - 1, 4) and got.logprobs.dtype == np.float32
        assert got.sampled_logprobs is not None
        assert got.sampled_logprobs.shape == (len(seqs[0]) - 1,)
        assert got.position_start == 1
        unasked = recorded_arrays(rows[0], 1, 3, RequestOptions(2, include_sampled=False))
        assert unasked.sampled_logprobs is None and unasked.ids.shape == (2, 2)
        empty = recorded_arrays(None, 4, 4, RequestOptions(3))
        assert empty.ids.shape == (0, 3) and empty.position_start == 4
        assert find_rows(reader, [(seqs[0].tobytes(), 2, 2)], RequestOptions(4), "rec") == [None]
        unknown = np.array([1, 2, 3], np.int32)
        with pytest.raises(NotRecordedError) as e:
            find_rows(reader, [keys[0], (unknown.tobytes(), 0, 3)], RequestOptions(4), "rec")
        assert str(e.value) == (
            "rec: not recorded at top_k 4, dtype float16, include_sampled True: "
            f"{describe_sequence(1, unknown)}: the sequence is not recorded"
        )
        with pytest.raises(
            NotRecordedError, match=r"^rec: top_k: 17 is more than the recorded K 16$"
        ):
            check_options(reader, RequestOptions(17), "rec")
        with pytest.raises(
            NotRecordedError, match="float16 log-probs, which do not give the teacher's float32"
        ):
            check_options(reader, RequestOptions(4, "float32"), "rec")


def test_a_recorded_option_is_stored_and_checked(tmp_path: Path) -> None:
    capped = _WithSoftCap(K, "float32", soft_cap=30.0)
    seqs = _recording(tmp_path / "capped", capped)
    meta = json.loads((tmp_path / "capped" / "metadata.json").read_text())
    unsampled = RequestOptions.recorded_defaults()  # the sampled-payload options' defaults
    assert meta["options"] == {**unsampled, "soft_cap": 30.0}
    with RecordingReader(tmp_path / "capped") as reader:
        assert reader.options == {**unsampled, "soft_cap": 30.0}
        key = [(seqs[0].tobytes(), 0, len(seqs[0]))]
        assert find_rows(reader, key, _WithSoftCap(4, soft_cap=30.0), "rec")[0] is not None
        with pytest.raises(
            NotRecordedError,
            match=r"soft_cap: the recording was made at 30\.0, the request asks for 0\.0",
        ):
            find_rows(reader, key, _WithSoftCap(4), "rec")
    # One recording, one value: the writer refuses a request made at another.
    with RecordingWriter(tmp_path / "capped", INFO) as w:
        req, resp = _answer(seqs[0], _WithSoftCap(K, "float32"))
        with pytest.raises(RecordingError, match="options: recorded"):
            w.write(req, resp, _WithSoftCap(K, "float32"))
    # A recording made before the option existed was made at its default.
    _recording(tmp_path / "plain", RequestOptions(K, "float32"))
    with RecordingReader(tmp_path / "plain") as reader:
        key = [(teacher_answer(6, seed=0)[0].tobytes(), 0, 6)]
        assert find_rows(reader, key, _WithSoftCap(4), "rec")[0] is not None
        with pytest.raises(NotRecordedError, match=r"soft_cap: the recording was made at 0\.0"):
            find_rows(reader, key, _WithSoftCap(4, soft_cap=1.0), "rec")
