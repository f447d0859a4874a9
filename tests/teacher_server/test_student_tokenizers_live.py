"""A student of another tokenizer through the live vLLM teacher (``--student-tokenizer``):

- identity: with the teacher's own tokenizer as the student's, every payload is byte for
  byte the plain request's;
- exactness, for two pairs (the repo's byte-level teacher with a BPE student; a BPE
  teacher with a BPE student of another vocabulary): every boundary row's top-k in
  student ids and every aligned row's chain-rule log-prob equal a dense float64
  transformers reference of the teacher computed here, by walking bytes (2e-4, ids equal
  where neighbours are apart), masked rows all NaN, on ragged batches with special
  tokens, multi-byte UTF-8, a student token spanning three teacher tokens and a teacher
  token spanning three student tokens, a first row inside a teacher token, and
  sub-ranges of positions (ending inside a teacher token);
- the answer's row counts and ``/metrics``;
- refusals naming the field (an unknown student tokenizer, an id outside its vocabulary,
  bytes the teacher's tokenizer does not reproduce), after which the server keeps
  serving.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import torch

from devtools.tiny_model import TINY_SERVE_ARGS, train_bpe_tokenizer, write_tiny_model
from student_client import TeacherClient
from tests.conftest import ServerProcess, start_server
from topk_protocol import decode_sequence, encode_token_ids, pb, pb_grpc

pytestmark = pytest.mark.vllm

TOL = 2e-4
K = 8
#: Texts for the tokenizers to learn from: the student's and the teacher's differ, so
#: their merges do too.
STUDENT_CORPUS = ["héllo wörld, the student reads again 🙂 and again"] * 40
TEACHER_CORPUS = ["héllo héllo wörld wörld teacher scores everything 🙂🙂"] * 40
TEXTS = [
    "héllo wörld 🙂",  # multi-byte UTF-8, an emoji of four bytes
    "the teacher scores<|endoftext|>héllo again",  # a special token in the middle
    "wörld",
]


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's printable character of each byte, inverted: character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_OF = _bytes_to_unicode()


def _pieces(tokenizer: Any, size: int) -> tuple[list[bytes], list[bool]]:
    """Each id's bytes and whether it is special, read from the vocabulary's byte-level
    strings (added tokens: their content; ids beyond the tokenizer: none)."""
    pieces, special = [b""] * size, [True] * size
    added = {int(i): t for i, t in tokenizer.added_tokens_decoder.items()}
    for token, i in tokenizer.get_vocab().items():
        if i in added:
            pieces[i], special[i] = added[i].content.encode(), bool(added[i].special)
        else:
            pieces[i], special[i] = bytes(BYTE_OF[c] for c in token), False
    return pieces, special


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class Oracle:
    """The expected student rows of a text: the teacher's dense float64 log-probs on its
    own tokens of the text, mapped to student rows by walking byte ends."""

    def __init__(self, model: Any, teacher_tok: Any, student_tok: Any, vocab: int) -> None:
        self.model, self.teacher_tok, self.student_tok = model, teacher_tok, student_tok
        self.t_pieces, self.t_special = _pieces(teacher_tok, vocab)
        self.s_pieces, s_special = _pieces(student_tok, len(student_tok))
        self.twin: dict[tuple[bool, bytes], int] = {}
        for i in sorted(range(len(self.s_pieces)), reverse=True):  # the lowest id wins
            if self.s_pieces[i]:
                self.twin[(s_special[i], self.s_pieces[i])] = i

    def rows(self, student_ids: list[int]) -> list[dict[str, Any]]:
        text = b"".join(self.s_pieces[i] for i in student_ids).decode()
        t_ids = _encode(self.teacher_tok, text)
        assert b"".join(self.t_pieces[i] for i in t_ids) == text.encode()
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([t_ids])).logits[0]
        dense = torch.log_softmax(logits.double(), -1).numpy()
        t_end: dict[int, int] = {}
        pos = 0
        for j, i in enumerate(t_ids):
            pos += len(self.t_pieces[i])
            t_end[pos] = j
        out, pos = [], 0
        for t, i in enumerate(student_ids):
            pos += len(self.s_pieces[i])
            j = t_end.get(pos)
            if j is None:
                out.append({"kind": "masked"})
                continue
            order = np.argsort(-dense[j], kind="stable")[:K]
            listed = [
                (self.twin[key], float(dense[j, v]))
                for v in order
                if (key := (self.t_special[v], self.t_pieces[v])) in self.twin
            ]
            row: dict[str, Any] = {"kind": "boundary", "listed": listed, "dense": dense[j]}
            if t + 1 < len(student_ids):
                stop = t_end.get(pos + len(self.s_pieces[student_ids[t + 1]]))
                first = t_ids[j + 1] if stop is not None else 0
                twin = self.twin.get((self.t_special[first], self.t_pieces[first]))
                # a chain of 2+ teacher tokens whose first one is listed: not served
                overlaps = stop is not None and stop - j >= 2 and twin in [i for i, _ in listed]
                if stop is not None and not overlaps:
                    row["kind"] = "aligned"
                    row["chain"] = sum(float(dense[r, t_ids[r + 1]]) for r in range(j, stop))
            out.append(row)
        return out


def check_rows(
    got_ids: np.ndarray, got_lps: np.ndarray, got_sampled: np.ndarray, want: list
) -> dict[str, int]:
    """Compare served rows ``[S, K]`` with the oracle's; the count of each kind."""
    counts = {"aligned": 0, "boundary": 0, "masked": 0}
    for r, row in enumerate(want):
        counts[row["kind"]] += 1
        if row["kind"] == "masked":
            assert np.isnan(got_lps[r]).all(), r
            assert np.isnan(got_sampled[r]), r
            continue
        listed = row["listed"]
        n = len(listed)
        np.testing.assert_allclose(got_lps[r, :n], [v for _, v in listed], rtol=0, atol=TOL)
        assert np.isneginf(got_lps[r, n:]).all(), r  # the teacher's other ids: no student twin
        values = np.array([v for _, v in listed] + [-np.inf])
        for c, (sid, v) in enumerate(listed):
            apart = (c == 0 or values[c - 1] - v > 2 * TOL) and v - values[c + 1] > 2 * TOL
            if apart:
                assert got_ids[r, c] == sid, (r, c)
        if row["kind"] == "aligned":
            np.testing.assert_allclose(got_sampled[r], row["chain"], rtol=0, atol=TOL)
        else:
            assert np.isnan(got_sampled[r]), r
    return counts


# -- servers ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def student_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bpe-student")
    train_bpe_tokenizer(STUDENT_CORPUS, 290).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bpe_teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's weights with a BPE tokenizer of its own (long merges)."""
    path = write_tiny_model(tmp_path_factory.mktemp("bpe-teacher"), seed=0)
    train_bpe_tokenizer(TEACHER_CORPUS, 400).save_pretrained(path)
    return path


def _serve(model: Path, students: dict[str, Path], log: Path) -> ServerProcess:
    flags = [a for n, d in students.items() for a in ("--student-tokenizer", f"{n}={d}")]
    return start_server(["--backend", "vllm", "--model", str(model), *TINY_SERVE_ARGS, *flags], log)


@pytest.fixture(scope="module")
def byte_teacher(
    tiny_model_dir: Path, student_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The repo's byte-level teacher, serving its own tokenizer as ``self`` and the BPE
    student as ``bpe``."""
    log = tmp_path_factory.mktemp("byte-teacher") / "server.log"
    server = _serve(tiny_model_dir, {"self": tiny_model_dir, "bpe": student_dir}, log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def bpe_teacher(
    bpe_teacher_dir: Path, student_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("bpe-teacher-server") / "server.log"
    server = _serve(bpe_teacher_dir, {"bpe": student_dir}, log)
    yield server
    server.stop()


def _model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return copy.deepcopy(AutoModelForCausalLM.from_pretrained(path)).double().eval()


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _score(server: ServerProcess, seqs: list[list[int]], **fields: Any) -> pb.ScoreResponse:
    """One raw ``Score`` call (K, float32 unless ``fields`` say otherwise; ``spans`` and
    ``candidates``, ``[S, C]`` per sequence, go to the sequences)."""
    request = pb.ScoreRequest(request_id="t", top_k=K, dtype=pb.LOGPROB_DTYPE_FLOAT32)
    spans = fields.pop("spans", None)
    candidates = fields.pop("candidates", None)
    for f, v in fields.items():
        setattr(request, f, v)
    for i, s in enumerate(seqs):
        seq = request.sequences.add(token_ids=encode_token_ids(np.asarray(s, np.int32)))
        if spans is not None:
            seq.position_start, seq.position_end = spans[i]
        if candidates is not None:
            seq.candidate_ids = np.asarray(candidates[i], "<i4").tobytes()
            seq.num_candidates = np.shape(candidates[i])[1]
    with grpc.insecure_channel(server.target) as channel:
        return pb_grpc.TeacherStub(channel).Score(request, timeout=120)


# -- tests -----------------------------------------------------------------------------
def test_the_teachers_own_tokenizer_gives_byte_identical_payloads(
    byte_teacher: ServerProcess, tiny_model_dir: Path
) -> None:
    tok = _tokenizer(tiny_model_dir)
    seqs = [_encode(tok, t) for t in TEXTS]
    for dtype in (pb.LOGPROB_DTYPE_FLOAT32, pb.LOGPROB_DTYPE_FLOAT16):
        for spans in (None, [(0, len(seqs[0])), (3, 17), (1, 2)]):
            plain = _score(byte_teacher, seqs, dtype=dtype, spans=spans)
            cross = _score(byte_teacher, seqs, dtype=dtype, spans=spans, student_tokenizer="self")
            assert len(plain.sequences) == len(cross.sequences) == len(seqs)
            for a, b in zip(plain.sequences, cross.sequences, strict=True):
                assert a.SerializeToString() == b.SerializeToString()
            assert cross.row_counts.masked == 0 and cross.row_counts.aligned > 0


def _student_batch(student_tok: Any) -> list[list[int]]:
    seqs = [_encode(student_tok, t) for t in TEXTS]
    assert 256 in seqs[1]  # <|endoftext|>, the special token of both tokenizers
    return seqs


def test_a_bpe_student_of_the_byte_level_teacher(
    byte_teacher: ServerProcess, tiny_model_dir: Path, student_dir: Path
) -> None:
    """Through ``TeacherClient(student_tokenizer=...)``: a ragged batch, every position,
    then sub-ranges."""
    student_tok = _tokenizer(student_dir)
    oracle = Oracle(_model(tiny_model_dir), _tokenizer(tiny_model_dir), student_tok, 512)
    seqs = _student_batch(student_tok)
    # a student token of three bytes or more: three teacher tokens or more
    assert any(len(oracle.s_pieces[i]) >= 3 for s in seqs for i in s)
    with TeacherClient(byte_teacher.target, student_tokenizer="bpe") as client:
        info = client.info()
        assert info.vocab_size == len(student_tok)
        spans = [(0, len(seqs[0])), (2, len(seqs[1]) - 3), (1, len(seqs[2]))]
        for positions in (None, spans):
            payload = client.score(seqs, K, dtype="float32", positions=positions)
            counts = {"aligned": 0, "boundary": 0, "masked": 0}
            for b, seq in enumerate(seqs):
                start, end = (0, len(seq)) if positions is None else positions[b]
                n = end - start
                want = oracle.rows(seq)[start:end]
                got = check_rows(
                    payload.ids[b, :n].numpy(),
                    payload.logprobs[b, :n].numpy(),
                    payload.sampled_logprobs[b, :n].numpy(),  # type: ignore[index]
                    want,
                )
                counts = {k: counts[k] + got[k] for k in counts}
            assert counts["aligned"] > 0


def test_a_bpe_teacher_and_a_bpe_student_of_another_vocabulary(
    bpe_teacher: ServerProcess, bpe_teacher_dir: Path, student_dir: Path
) -> None:
    """Masked rows where a student token ends inside a teacher token (a teacher token of
    three student tokens and more, a first row inside one), sub-ranges ending inside
    one; the answer's counts and ``/metrics``."""
    student_tok = _tokenizer(student_dir)
    teacher_tok = _tokenizer(bpe_teacher_dir)
    oracle = Oracle(_model(bpe_teacher_dir), teacher_tok, student_tok, 512)
    seqs = [*_student_batch(student_tok), _encode(student_tok, "héllohéllo wörldwörld")]
    wants = [oracle.rows(s) for s in seqs]
    kinds = [[r["kind"] for r in w] for w in wants]
    assert any(k[0] == "masked" for k in kinds)  # a first row inside a teacher token
    assert any("masked, masked" in ", ".join(k) for k in kinds)  # 3+ student tokens in one
    metrics_before = _student_rows_metric(bpe_teacher)
    total = {"aligned": 0, "boundary": 0, "masked": 0}
    for spans in (None, [(0, len(s)) for s in seqs], _spans_ending_masked(kinds)):
        answer = _score(bpe_teacher, seqs, student_tokenizer="bpe", spans=spans)
        counts = {"aligned": 0, "boundary": 0, "masked": 0}
        for b, msg in enumerate(answer.sequences):
            rows = decode_sequence(msg)
            start = rows.position_start
            got = check_rows(
                rows.ids,
                rows.logprobs,
                rows.sampled_logprobs,  # type: ignore[arg-type]
                wants[b][start : start + rows.num_positions],
            )
            counts = {k: counts[k] + got[k] for k in counts}
        assert counts == {
            "aligned": answer.row_counts.aligned,
            "boundary": answer.row_counts.boundary,
            "masked": answer.row_counts.masked,
        }
        total = {k: total[k] + counts[k] for k in total}
    assert total["masked"] > 0 and total["aligned"] > 0
    after = _student_rows_metric(bpe_teacher)
    assert {k: after[k] - metrics_before[k] for k in total} == total


def _spans_ending_masked(kinds: list[list[str]]) -> list[tuple[int, int]]:
    """Per sequence, positions from 1 up to and including its last masked row."""
    spans = []
    for k in kinds:
        last = max((i for i, kind in enumerate(k) if kind == "masked"), default=len(k) - 1)
        spans.append((min(1, last), last + 1))
    return spans


def _student_rows_metric(server: ServerProcess) -> dict[str, float]:
    text = requests.get(f"{server.http}/metrics", timeout=30).text
    out = {"aligned": 0.0, "boundary": 0.0, "masked": 0.0}
    for kind in out:
        found = re.search(rf'^topk_teacher_student_rows_total{{kind="{kind}"}} (\S+)$', text, re.M)
        out[kind] = float(found.group(1)) if found else 0.0
    return out


def test_refusals_name_the_field_and_the_server_keeps_serving(
    byte_teacher: ServerProcess, student_dir: Path
) -> None:
    student_tok = _tokenizer(student_dir)
    good = _encode(student_tok, "héllo")
    # e + U+0301 in byte ids (the student's ids 0..255 are the bytes): the teacher's
    # tokenizer (NFC) spells it as é, other bytes
    decomposed = list("he\u0301llo".encode())
    bpe = {"student_tokenizer": "bpe"}
    cases = [
        ({"student_tokenizer": "nope"}, [good],
         r"^student_tokenizer: 'nope' is not served here \(served: 'bpe', 'self'"),
        (bpe, [[*good, 290]],
         r"^sequences\[0\]\.token_ids\[\d+\]: 290 is outside the vocabulary \[0, 290\)"),
        (bpe, [good, [0xC3]],
         r"^sequences\[1\]\.token_ids: the student's tokens spell bytes that are not UTF-8"),
        (bpe, [decomposed],
         r"^sequences\[0\]\.token_ids: the teacher's tokenizer does not reproduce"),
        ({**bpe, "samples": 2, "seed": 1, "top_k": 2}, [good],
         r"^student_tokenizer: 'bpe' is served with top-k payloads only"),
        ({**bpe, "encoding": pb.PAYLOAD_ENCODING_PACKED}, [good],
         r"^encoding: 'packed' with student_tokenizer 'bpe' is not served"),
    ]  # fmt: skip
    for fields, seqs, pattern in cases:
        with pytest.raises(grpc.RpcError) as err:
            _score(byte_teacher, seqs, **fields)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert re.search(pattern, err.value.details() or ""), (pattern, err.value.details())
    answer = _score(byte_teacher, [good], student_tokenizer="bpe")
    assert answer.row_counts.aligned == len(good) - 1
    client = TeacherClient(byte_teacher.target, student_tokenizer="other")
    with client, pytest.raises(Exception, match="student_tokenizer: 'other' is not served"):
        client.info()


def test_a_recording_of_a_student_tokenizers_answers_replays(
    byte_teacher: ServerProcess, student_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Recorded with the student tokenizer's vocabulary and fingerprint, at that request
    option: replay answers the same rows (masked ones NaN as sent), refuses a request in
    the teacher's own ids and a student expecting the teacher's tokenizer, by name."""
    from student_client.offline.replay_client import ReplayClient
    from topk_protocol.errors import NotRecordedError, VocabMismatchError
    from topk_protocol.info import tokenizer_fingerprint

    student_tok = _tokenizer(student_dir)
    seqs = _student_batch(student_tok)
    recording = tmp_path / "recording"
    with TeacherClient(byte_teacher.target, student_tokenizer="bpe", record_to=recording) as c:
        live = c.score(seqs, K, dtype="float32")
        with pytest.raises(Exception, match=r"sequences\[0\]\.token_ids\[0\]: 290 is outside"):
            c.score([[290, *seqs[0]]], K, dtype="float32")  # refused: nothing recorded lost
    fingerprint = tokenizer_fingerprint(student_tok)
    with ReplayClient(
        recording, expect_vocab_size=len(student_tok), expect_tokenizer_fingerprint=fingerprint
    ) as replay:
        again = replay.score(seqs, K, dtype="float32", student_tokenizer="bpe")
        torch.testing.assert_close(again.logprobs, live.logprobs, equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(again.ids, live.ids, rtol=0, atol=0)
        with pytest.raises(NotRecordedError, match="student_tokenizer: the recording was made"):
            replay.score(seqs, K, dtype="float32")
    teacher_fp = tokenizer_fingerprint(_tokenizer(tiny_model_dir))
    with pytest.raises(VocabMismatchError, match="tokenizer_fingerprint"):
        ReplayClient(recording, expect_tokenizer_fingerprint=teacher_fp)


def test_the_async_and_multi_teacher_clients_send_it_too(
    byte_teacher: ServerProcess, student_dir: Path
) -> None:
    """The same batch through the blocking, asyncio and multi-teacher clients made with
    ``student_tokenizer``: the same rows (the multi-teacher one routes to one name)."""
    import asyncio

    from student_client import AsyncTeacherClient, MultiTeacherClient

    seqs = _student_batch(_tokenizer(student_dir))
    with TeacherClient(byte_teacher.target, student_tokenizer="bpe") as client:
        want = client.score(seqs, K, dtype="float32")

    async def scored() -> Any:
        async with AsyncTeacherClient(byte_teacher.target, student_tokenizer="bpe") as aio:
            return await aio.score(seqs, K, dtype="float32")

    multi = MultiTeacherClient({"byte": byte_teacher.target}, student_tokenizer="bpe")
    with multi:
        routed = multi.score(seqs, K, dtype="float32", teacher=["byte"] * len(seqs))
    for got in (asyncio.run(scored()), routed):
        torch.testing.assert_close(got.ids, want.ids, rtol=0, atol=0)
        torch.testing.assert_close(got.logprobs, want.logprobs, equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(
            got.sampled_logprobs, want.sampled_logprobs, equal_nan=True, rtol=0, atol=0
        )


def test_candidates_that_are_one_teacher_token(
    bpe_teacher: ServerProcess, bpe_teacher_dir: Path, student_dir: Path
) -> None:
    """Student candidate ids whose bytes are one teacher token: the teacher's log-prob of
    that token at each boundary row (the dense reference), NaN on masked rows and on -1;
    one whose bytes the teacher spells otherwise is refused naming it."""
    student_tok, teacher_tok = _tokenizer(student_dir), _tokenizer(bpe_teacher_dir)
    oracle = Oracle(_model(bpe_teacher_dir), teacher_tok, student_tok, 512)
    teacher_id = {}
    for i in sorted(range(len(oracle.t_pieces)), reverse=True):  # the lowest id wins
        if oracle.t_pieces[i]:
            teacher_id[(oracle.t_special[i], oracle.t_pieces[i])] = i
    one = [i for i in range(258, len(student_tok)) if (False, oracle.s_pieces[i]) in teacher_id]
    several = next(
        i for i in range(258, len(student_tok)) if (False, oracle.s_pieces[i]) not in teacher_id
    )
    seq = _encode(student_tok, "héllohéllo wörld the teacher")
    columns = [ord("h"), ord("w"), -1, one[0], one[-1]]
    cand = np.tile(np.asarray(columns, np.int32), (len(seq), 1))
    answer = _score(bpe_teacher, [seq], student_tokenizer="bpe", candidates=[cand])
    got = decode_sequence(answer.sequences[0], cand)
    assert got.candidate_logprobs is not None
    want = oracle.rows(seq)
    with torch.inference_mode():
        t_ids = _encode(teacher_tok, "héllohéllo wörld the teacher")
        logits = oracle.model(input_ids=torch.tensor([t_ids])).logits[0]
    dense = torch.log_softmax(logits.double(), -1).numpy()
    t_end, pos = {}, 0
    for j, i in enumerate(t_ids):
        pos += len(oracle.t_pieces[i])
        t_end[pos] = j
    pos = 0
    for r, sid in enumerate(seq):
        pos += len(oracle.s_pieces[sid])
        if want[r]["kind"] == "masked":
            assert np.isnan(got.candidate_logprobs[r]).all()
            continue
        j = t_end[pos]
        for c, student_id in enumerate(columns):
            value = got.candidate_logprobs[r, c]
            if student_id < 0:
                assert np.isnan(value)
                continue
            t = teacher_id[(False, oracle.s_pieces[student_id])]
            np.testing.assert_allclose(value, dense[j, t], rtol=0, atol=TOL)
    bad = cand.copy()
    bad[3, 2] = several
    with pytest.raises(grpc.RpcError) as err:
        _score(bpe_teacher, [seq], student_tokenizer="bpe", candidates=[bad])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(
        rf"^sequences\[0\]\.candidate_ids\[3\]\[2\]: student id {several} is not one teacher token",
        err.value.details() or "",
    ), err.value.details()
