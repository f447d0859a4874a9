"""Packed recordings: the teacher's packed answers recorded as such (binary columns,
checksummed), replayed byte-identically by ``ReplayClient``, ``PayloadDataset`` and the
replay backend; what a packed or a float recording answers, and the named refusals."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from recording_fakes import INFO, K, assert_bit_equal, live_payload, teacher_answer

from student_client.data.assembler import ResponseAssembler
from student_client.offline.dataset import PayloadDataset, collate_payloads
from student_client.offline.replay_client import ReplayClient, replay_response
from teacher_server.backends.replay_backend import ReplayBackend
from teacher_server.grpc_api.answers import encode_response, iter_stream_responses
from teacher_server.validation import Limits, parse_request
from topk_protocol import RequestOptions, build_request, decode_sequence, pb, request_spans
from topk_protocol.errors import NotRecordedError, RecordingDamagedError, RecordingError
from topk_protocol.recording import RecordingReader, RecordingWriter
from topk_protocol.recording.replay import serves_encodings

BITS = 6


def _corpus(n: int = 6) -> dict[bytes, object]:
    out = {}
    for i in range(n):
        tokens, full = teacher_answer(5 + 4 * i, seed=100 + i)
        out[tokens.tobytes()] = (tokens, full)
    return out


def _record(path: Path, corpus: dict, **options: object) -> None:
    """Record the teacher's streamed answers (small chunks) as the client does:
    assembled, merged, written."""
    with RecordingWriter(path, INFO) as writer:
        for tokens, full in corpus.values():
            req = build_request([tokens], K, request_id="r", **options)
            asm = ResponseAssembler(req)
            for msg in iter_stream_responses(
                "r", [full], RequestOptions.from_proto(req), chunk_bytes=200, vocab_size=512
            ):
                asm.add(msg)
            writer.write(req, asm.merged_response())


@pytest.fixture
def packed(tmp_path: Path) -> tuple[Path, dict]:
    corpus = _corpus()
    path = tmp_path / "packed"
    _record(path, corpus, encoding="packed", logprob_bits=BITS)
    return path, corpus


def test_packed_recording_stores_the_packed_bytes(packed: tuple[Path, dict]) -> None:
    path, corpus = packed
    with RecordingReader(path) as r:
        assert r.packing is not None and r.packing.logprob_bits == BITS
        assert r.metadata["encoding"] == "packed"
        assert serves_encodings(r) == ("packed",)
        assert not r.verify()
    table = pa.ipc.open_stream(pa.memory_map(str(sorted(path.glob("*.arrow"))[0]))).read_all()
    assert table.schema.field("packed_ids").type == pa.binary()
    assert "ids" not in table.schema.names and "logprobs" not in table.schema.names
    # the stored bytes are the teacher's one-message answer's
    tokens, full = next(iter(corpus.values()))
    req = build_request([tokens], K, encoding="packed", logprob_bits=BITS)
    answer = pb.ScoreResponse.FromString(
        encode_response(parse_request(req, Limits(vocab_size=512, max_top_k=64)), [full], 0.0)
    )
    row = table.slice(0, 1).to_pylist()[0]
    assert row["packed_ids"] == answer.sequences[0].packed_ids
    assert row["packed_logprobs"] == answer.sequences[0].packed_logprobs


@pytest.mark.parametrize("sampled", [True, False])
def test_replay_client_and_dataset_are_byte_identical(
    packed: tuple[Path, dict], sampled: bool
) -> None:
    path, corpus = packed
    full_corpus = {k: v[1] for k, v in corpus.items()}
    seqs = [t for t, _ in corpus.values()][::-1][:4]
    opts = {"encoding": "packed", "logprob_bits": BITS, "include_sampled": sampled}
    want = live_payload(full_corpus, seqs, K, **opts)
    with ReplayClient(path) as replay:
        assert replay.info().supported_encodings == ("packed",)
        assert_bit_equal(want, replay.score(seqs, K, **opts))
        # a sub-range of positions is answered exactly too
        spans = [(1, len(s) - 1) for s in seqs]
        assert_bit_equal(
            live_payload(full_corpus, seqs, K, positions=spans, **opts),
            replay.score(seqs, K, positions=spans, **opts),
        )
        # the raw answer bytes equal the teacher's
        req = build_request(seqs, K, request_id="x", **opts)
        scored = [
            full_corpus[s.token_ids].positions(a, b)
            for s, (a, b) in zip(req.sequences, request_spans(req), strict=True)
        ]
        teacher = encode_response(parse_request(req, Limits(vocab_size=512)), scored, 0.0)
        replayed = replay_response(replay._reader, req)
        assert (
            replayed.SerializeToString() == pb.ScoreResponse.FromString(teacher).SerializeToString()
        )
    ds = PayloadDataset(path, include_sampled=sampled)
    index = {ds[i].token_ids.numpy().astype(np.int32).tobytes(): i for i in range(len(ds))}
    batch = collate_payloads([ds[index[s.tobytes()]] for s in seqs])
    assert_bit_equal(want, batch.payload)


def test_replay_backend_answers_byte_identically(packed: tuple[Path, dict]) -> None:
    path, corpus = packed
    backend = ReplayBackend(path)
    asyncio.run(backend.start())
    try:
        assert backend.supported_encodings == ("packed",)
        tokens, full = next(iter(corpus.values()))
        req = build_request([tokens], K, encoding="packed", logprob_bits=BITS)
        parsed = parse_request(req, Limits(vocab_size=512))
        backend.check_request(parsed)
        seq = parsed.sequences[0]
        arrays = asyncio.run(backend.score(seq, parsed.options))
        assert encode_response(parsed, [arrays], 0.0) == encode_response(parsed, [full], 0.0)
    finally:
        asyncio.run(backend.close())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "encoding: the recording holds packed payloads"),
        (
            {"encoding": "packed", "logprob_bits": BITS + 1},
            "logprob_bits: the packed recording holds 6",
        ),
        (
            {"encoding": "packed", "logprob_bits": BITS, "dtype": "float32"},
            "dtype: the packed recording holds 'float16'",
        ),
    ],
)
def test_packed_recording_refuses_what_it_cannot_answer_exactly(
    packed: tuple[Path, dict], options: dict, message: str
) -> None:
    path, corpus = packed
    tokens = next(iter(corpus.values()))[0]
    with ReplayClient(path) as replay, pytest.raises(NotRecordedError, match=message):
        replay.score([tokens], K, **options)
    with ReplayClient(path) as replay, pytest.raises(NotRecordedError, match="top_k: the packed"):
        replay.score([tokens], K - 1, encoding="packed", logprob_bits=BITS)


def test_a_float32_recording_answers_packed_requests_and_float16_does_not(
    tmp_path: Path,
) -> None:
    corpus = _corpus(3)
    full_corpus = {k: v[1] for k, v in corpus.items()}
    seqs = [t for t, _ in corpus.values()]
    f32 = tmp_path / "f32"
    _record(f32, corpus, dtype="float32")
    opts = {"encoding": "packed", "logprob_bits": 4}
    with ReplayClient(f32) as replay:
        assert replay.info().supported_encodings == ("default", "packed")
        for k in (K, 3):  # any K' <= K: the teacher packs its float32 top-K'
            assert_bit_equal(
                live_payload(full_corpus, seqs, k, **opts), replay.score(seqs, k, **opts)
            )
    ds = PayloadDataset(f32, top_k=3, dtype="float16", include_sampled=False, **opts)  # type: ignore[arg-type]
    batch = collate_payloads([ds[i] for i in range(len(ds))])
    order = [ds[i].token_ids.numpy().astype(np.int32) for i in range(len(ds))]
    assert_bit_equal(
        live_payload(full_corpus, order, 3, dtype="float16", include_sampled=False, **opts),
        batch.payload,
    )
    f16 = tmp_path / "f16"
    _record(f16, corpus)
    with (
        ReplayClient(f16) as replay,
        pytest.raises(NotRecordedError, match="encoding: the recording holds float16 payloads"),
    ):
        replay.score(seqs, K, **opts)


def test_writer_refuses_answers_that_do_not_give_its_bytes(packed: tuple[Path, dict]) -> None:
    path, _ = packed
    tokens, full = teacher_answer(9, seed=999)
    with RecordingWriter(path, INFO) as writer:
        with pytest.raises(
            RecordingError, match="encoding: the recording packs K 16 float16 at 6 bits"
        ):
            writer.add(tokens, full, dtype="float16")
        assert writer.add(
            tokens, full, dtype="float32"
        )  # float32 values: packed as the teacher packs


def test_a_flipped_byte_of_a_packed_row_is_caught(packed: tuple[Path, dict]) -> None:
    """The shard rewritten with one bit of row 0's packed ids flipped (the checksum
    column kept): the row is reported damaged, naming the checksum."""
    path, _ = packed
    shard = sorted(path.glob("*.arrow"))[0]
    table = pa.ipc.open_stream(pa.memory_map(str(shard))).read_all()
    rows = table.column("packed_ids").to_pylist()
    rows[0] = bytes([rows[0][0] ^ 0x01]) + rows[0][1:]
    index = table.schema.get_field_index("packed_ids")
    table = table.set_column(index, table.schema.field(index), pa.array(rows, pa.binary()))
    with pa.OSFile(str(shard), "wb") as f, pa.ipc.new_stream(f, table.schema) as out:
        out.write_table(table)
    with RecordingReader(path) as r:
        damaged = r.verify()
    assert len(damaged) == 1 and isinstance(damaged[0], RecordingDamagedError)
    assert "checksum mismatch" in str(damaged[0])


def test_resuming_with_another_encoding_is_refused(packed: tuple[Path, dict]) -> None:
    path, _ = packed
    with pytest.raises(RecordingError, match="packing: recorded Packing"):
        RecordingWriter(path, INFO, encoding="default")
    with pytest.raises(RecordingError, match="packing: recorded Packing"):
        RecordingWriter(path, INFO, encoding="packed", logprob_bits=BITS + 1)
    RecordingWriter(path, INFO, encoding="packed", logprob_bits=BITS).close()


def test_a_packed_recording_with_candidates_replays_byte_identically(tmp_path: Path) -> None:
    """Packed top-k and unpacked candidate log-probs in one recording: the stored row
    reads back whole, and replaying the request answers the teacher's bytes."""
    rng = np.random.default_rng(7)
    tokens, full = teacher_answer(11, seed=3)
    cand = rng.integers(-1, 512, (10, 5)).astype(np.int32)  # positions [1, 11)
    clp = np.where(cand == -1, np.nan, -rng.exponential(3.0, cand.shape)).astype(np.float32)
    row = replace(full.positions(1, 11), candidate_ids=cand, candidate_logprobs=clp)
    req = build_request(
        [tokens], K, positions=[(1, 11)], request_id="r", encoding="packed",
        logprob_bits=BITS, candidate_ids=[cand],
    )  # fmt: skip
    asm = ResponseAssembler(req)
    for msg in iter_stream_responses(
        "r", [row], RequestOptions.from_proto(req), chunk_bytes=200, vocab_size=512
    ):
        asm.add(msg)
    live = asm.merged_response()
    path = tmp_path / "packed-candidates"
    with RecordingWriter(path, INFO) as writer:
        assert writer.write(req, live) == 1
    with RecordingReader(path) as r:
        assert r.packing is not None and not r.verify()
        answer = replay_response(r, req)
    assert answer.SerializeToString() == live.SerializeToString()
    back = decode_sequence(answer.sequences[0], cand).candidate_logprobs
    assert back is not None and np.array_equal(
        back, clp.astype(np.float16).astype(np.float32), equal_nan=True
    )
