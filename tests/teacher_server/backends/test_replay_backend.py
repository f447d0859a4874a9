"""``teacher-server --backend replay`` over real gRPC: recorded values or NOT_FOUND naming
what is missing, never NaN in place of requested data (a copy without sampled log-probs is
passed over for one that has them; none has them: NOT_FOUND)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from recording_fakes import INFO, K, assert_bit_equal, live_payload, teacher_answer

from student_client.clients.blocking import TeacherClient
from student_client.offline.replay_client import ReplayClient
from topk_protocol.errors import DataLossError, NotRecordedError
from topk_protocol.recording import RecordingWriter


def test_replay_server_serves_recorded_values_or_not_found(
    tmp_path: Path, teacher_factory: Callable[..., Any]
) -> None:
    path = tmp_path / "rec"
    a_tok, a = teacher_answer(25, seed=1)  # two copies: without sampled, then with
    b_tok, b = teacher_answer(18, seed=2)  # recorded without sampled only
    with RecordingWriter(path, INFO, top_k=K, dtype="float32") as w:
        w.add(a_tok, replace(a, sampled_logprobs=None), dtype="float32")
        w.add(b_tok, replace(b, sampled_logprobs=None), dtype="float32")
        w.add(a_tok, a, dtype="float32")
    corpus = {a_tok.tobytes(): a, b_tok.tobytes(): b}
    server = teacher_factory(["--backend", "replay", "--recording", str(path)])
    with TeacherClient(server.target) as client, ReplayClient(path) as replay:
        assert client.info().backend == "replay"
        # Case 1: the first copy of `a` has no sampled log-probs, the other one has.
        for dtype in ("float32", "float16", "bfloat16"):
            got = client.score([a_tok], 7, dtype=dtype)
            assert_bit_equal(live_payload(corpus, [a_tok], 7, dtype=dtype), got)
            assert got.sampled_logprobs is not None
            assert not got.sampled_logprobs[0, :-1].isnan().any()  # NaN only at L-1
            assert_bit_equal(replay.score([a_tok], 7, dtype=dtype), got)
        # Case 2: no copy of `b` has them: NOT_FOUND naming it, in Score and in a stream.
        with pytest.raises(
            NotRecordedError,
            match=r"sequences\[1\] \(18 tokens starting.*sampled log-probs are not recorded",
        ):
            client.score([a_tok, b_tok], 4)
        it = client.stream([[a_tok], [b_tok]], 4)
        next(it)
        with pytest.raises(NotRecordedError, match="sampled log-probs are not recorded"):
            next(it)
        # Without sampled log-probs, `b` is served.
        got = client.score([b_tok, a_tok], 4, include_sampled=False, positions=[(3, 9), (0, 25)])
        want = live_payload(
            corpus, [b_tok, a_tok], 4, include_sampled=False, positions=[(3, 9), (0, 25)]
        )
        assert_bit_equal(want, got)
        with pytest.raises(NotRecordedError, match="top_k: 17 is more than the recorded K 16"):
            client.score([a_tok], 17)
        with pytest.raises(
            NotRecordedError, match=r"sequences\[0\] \(3 tokens starting \[1, 2, 3\]\)"
        ):
            client.score([[1, 2, 3]], 4, include_sampled=False)
        assert torch.equal(
            client.score([a_tok], 1).ids[0, :, 0], torch.from_numpy(a.ids[:, 0]).long()
        )
    assert np.isnan(a.sampled_logprobs[-1])


def test_replay_server_answers_a_damaged_row_with_data_loss_and_serves_the_others(
    tmp_path: Path, teacher_factory: Callable[..., Any]
) -> None:
    path = tmp_path / "rec"
    a_tok, a = teacher_answer(20, seed=3)
    b_tok, b = teacher_answer(22, seed=4)
    with RecordingWriter(path, INFO, top_k=K, dtype="float32", compression="none") as w:
        w.add(a_tok, a, dtype="float32")
        w.add(b_tok, b, dtype="float32")
    (shard,) = path.glob("*.arrow")
    data = bytearray(shard.read_bytes())
    data[bytes(data).index(b.logprobs.tobytes()) + 5] ^= 0x10  # one bit of row 1
    shard.write_bytes(bytes(data))
    server = teacher_factory(["--backend", "replay", "--recording", str(path)])
    with TeacherClient(server.target) as client:
        with pytest.raises(DataLossError, match=rf"{shard.name}: row 1: checksum mismatch"):
            client.score([a_tok, b_tok], 4)
        got = client.score([a_tok], 4)  # the intact row is served, and the server goes on
        want = live_payload({a_tok.tobytes(): a}, [a_tok], 4)
        assert_bit_equal(want, got)
