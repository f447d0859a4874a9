"""Recordings store the teacher's answer fingerprint: resuming with a teacher that answers
otherwise, or reading / verifying parts recorded by disagreeing replicas, is refused by
name; agreeing replicas' parts read as one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from recording_fakes import INFO, K, teacher_answer

from student_client.offline.dataset import PayloadDataset
from student_client.offline.verify import verify
from topk_protocol import pb
from topk_protocol.errors import NotRecordedError, RecordingError
from topk_protocol.fingerprint import AnswerFingerprint
from topk_protocol.recording import RecordingWriter
from topk_protocol.recording.sharded import part_location


def _info(shift: float, dtype: str = "float32") -> pb.TeacherInfo:
    rng = np.random.default_rng(0)
    lps = -np.cumsum(rng.uniform(0.05, 0.5, size=(256, 8)), axis=1).astype(np.float32)
    ids = np.stack([rng.permutation(512)[:8] for _ in range(256)]).astype(np.int32)
    fp = AnswerFingerprint("v1:4x64", ids, lps + np.float32(shift), 1e-3, dtype, "fake")
    info = pb.TeacherInfo()
    info.CopyFrom(INFO)
    info.answer_fingerprint.CopyFrom(fp.to_message())
    return info


def _record(path: str | Path, info: pb.TeacherInfo, seeds: range) -> None:
    with RecordingWriter(path, info, top_k=K, dtype="float32") as w:
        for i in seeds:
            tokens, full = teacher_answer(5 + i, seed=i)
            w.add(tokens, full, dtype="float32")


def test_metadata_holds_the_fingerprint_and_resume_needs_agreement(tmp_path: Path) -> None:
    path = tmp_path / "rec"
    _record(path, _info(0.0), range(3))
    _record(path, _info(2e-4), range(3, 5))  # another replica within the drift: appends
    with pytest.raises(RecordingError, match="cannot append: answer_fingerprint: this teacher"):
        _record(path, _info(0.01), range(5, 6))
    ds = PayloadDataset(path)
    assert len(ds) == 5
    assert AnswerFingerprint.of_info(ds.reader.info) is not None


def test_parts_of_disagreeing_replicas_are_refused_by_name(tmp_path: Path) -> None:
    root = tmp_path / "out"
    first, second = part_location(root, 0, 2), part_location(root, 1, 2)
    _record(first, _info(0.0), range(3))
    _record(second, _info(0.0, "bfloat16"), range(3, 6))
    with pytest.raises(NotRecordedError) as e:
        PayloadDataset(root)
    assert str(e.value).startswith(
        f"{second}: answer_fingerprint: this teacher (model 'fake', dtype bfloat16) "
        f"disagrees with the teacher of {first} (model 'fake', dtype float32): engine dtype"
    )
    problems = verify(str(root)).problems
    assert any(p.startswith(f"{second}: answer_fingerprint:") for p in problems)


def test_parts_of_agreeing_replicas_read_as_one(tmp_path: Path) -> None:
    root = tmp_path / "out"
    _record(part_location(root, 0, 2), _info(0.0), range(3))
    _record(part_location(root, 1, 2), _info(3e-4), range(3, 6))
    assert len(PayloadDataset(root)) == 6
    assert not [p for p in verify(str(root)).problems if "answer_fingerprint" in p]
