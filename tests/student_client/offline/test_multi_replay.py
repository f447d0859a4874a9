"""A multi-teacher recording without servers: two teachers' (fake) answers for the same
sequences, recorded one recording per teacher; ReplayClient routes each row to its
teacher's rows bit for bit, the payload dataset carries the teacher column, and a teacher
of the manifest with no rows yet is known to routing and refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from recording_fakes import INFO, K, assert_bit_equal, live_payload, teacher_answer

from student_client.clients.routing import merge_payloads
from student_client.offline.dataset import PayloadDataset
from student_client.offline.multi_replay import MultiReplayClient
from student_client.offline.replay_client import ReplayClient
from topk_protocol.errors import NotRecordedError
from topk_protocol.recording import RecordingWriter
from topk_protocol.recording.multi_recording import teacher_recording_path, write_manifest


def _record(root: Path) -> tuple[list[np.ndarray], dict[str, dict[bytes, object]]]:
    seqs, corpora = [], {}
    for name, seed in (("code", 0), ("docs", 100)):
        corpus: dict[bytes, object] = {}
        with RecordingWriter(teacher_recording_path(root, name), INFO) as w:
            for i, n in enumerate((5, 9, 3)):
                tokens, _ = teacher_answer(n, i)  # the same sequences for both teachers
                _, answer = teacher_answer(n, seed + i)  # different answers
                corpus[tokens.tobytes()] = answer
                w.add(tokens, answer, dtype="float32")
                if name == "code":
                    seqs.append(tokens)
        corpora[name] = corpus
    write_manifest(root, ["code", "docs", "math"])  # math: no rows yet
    return seqs, corpora


def test_routed_replay_and_teacher_column(tmp_path: Path) -> None:
    seqs, corpora = _record(tmp_path)
    route = ["docs", "code", "docs"]
    with MultiReplayClient(tmp_path) as replay:
        assert replay.names == ["code", "docs", "math"] and len(replay) == 6
        got = replay.score(seqs, K, teacher=route, positions=[(1, 4), (0, 9), (0, 3)])
        parts = []
        for name in ("docs", "code"):
            rows = [i for i, t in enumerate(route) if t == name]
            spans = [[(1, 4), (0, 9), (0, 3)][i] for i in rows]
            part = live_payload(corpora[name], [seqs[i] for i in rows], K, positions=spans)  # type: ignore[arg-type]
            parts.append((rows, part))
        want = merge_payloads(parts, route)
        assert got.teachers == tuple(route)
        assert_bit_equal(got, want)
        with pytest.raises(NotRecordedError, match=r"teacher 'math': .*nothing recorded"):
            replay.score(seqs[:1], K, teacher="math")
    ds = PayloadDataset(tmp_path)
    assert ds.teachers == ["code", "docs"] and len(ds) == 6
    names = [ds[i].teacher for i in range(len(ds))]
    assert names == ["code"] * 3 + ["docs"] * 3
    item = ds[4]
    answer = corpora["docs"][item.token_ids.numpy().astype(np.int32).tobytes()]
    assert np.array_equal(item.arrays.ids, answer.ids)  # type: ignore[attr-defined]
    with ReplayClient(tmp_path, teacher="docs") as one:
        single = one.score(seqs[:2], K)
    assert_bit_equal(single, live_payload(corpora["docs"], seqs[:2], K))  # type: ignore[arg-type]
    with pytest.raises(NotRecordedError, match="'math' is not recorded"):
        ReplayClient(tmp_path, teacher="math")
    with pytest.raises(ValueError, match=r"multi-teacher recording .*MultiReplayClient\(path\)"):
        ReplayClient(tmp_path)
    with pytest.raises(ValueError, match=r"single-teacher recording: open it with ReplayClient"):
        MultiReplayClient(tmp_path / "docs")
