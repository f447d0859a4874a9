"""The multi-teacher client against two live teachers on two different tiny models (the
session's vLLM teacher, and a transformers-backed one on other weights): random routings
of ragged batches, sub-ranges and attention masks give, row for row and bit for bit, what
each row's teacher answers when asked directly; the connect-time checks refuse a teacher
with another vocabulary, naming it, before any request."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import ServerProcess, start_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_client_live import requests_ok

from devtools.tiny_model import write_tiny_model
from student_client.client import ScoreBatch, TeacherClient
from student_client.errors import InvalidRequestError, TeacherMismatchError, VocabMismatchError
from student_client.multi_client import AsyncMultiTeacherClient, MultiTeacherClient
from student_client.payload import TeacherPayload
from student_client.routing import check_agreement
from topk_protocol import TeacherInfo

pytestmark = pytest.mark.vllm

K = 8
NAMES = ("vllm", "other")


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A transformers-backed teacher on another tiny model (seed 1: other weights, same
    vocabulary and tokenizer)."""
    tmp = tmp_path_factory.mktemp("other-teacher")
    model = write_tiny_model(tmp / "model", seed=1)
    args = ["--backend", "transformers", "--model", str(model), "--max-top-k", "64"]
    server = start_server(args, tmp / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def clients(
    vllm_teacher: ServerProcess, other_teacher: ServerProcess
) -> Iterator[tuple[MultiTeacherClient, dict[str, TeacherClient]]]:
    targets = {"vllm": vllm_teacher.target, "other": other_teacher.target}
    direct = {name: TeacherClient(t) for name, t in targets.items()}
    with MultiTeacherClient(targets) as multi:
        yield multi, direct
    for c in direct.values():
        c.close()


def _fields(p: TeacherPayload, b: int | slice) -> list[torch.Tensor]:
    """The payload's tensors at row ``b``, floats as their bits (NaN compares equal)."""
    assert p.sampled_logprobs is not None
    return [p.ids[b], p.logprobs[b].view(torch.int32), p.sampled_logprobs[b].view(torch.int32), p.mask[b]]


def _assert_row_equal(got: TeacherPayload, b: int, want: TeacherPayload) -> None:
    """Row ``b`` of the routed payload is row 0 of the direct one, bit for bit (the routed
    payload may be padded further: those rows are padding)."""
    s = want.ids.shape[1]
    for g, w in zip(_fields(got, b), _fields(want, 0), strict=True):
        assert torch.equal(g[:s], w), b
        assert not g[s:].any()  # padding: zeros, mask False
    assert int(got.position_start[b]) == int(want.position_start[0])
    assert int(got.lengths[b]) == int(want.lengths[0])


@st.composite
def routed_batches(draw: st.DrawFn) -> dict[str, Any]:
    b = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, 40), min_size=b, max_size=b))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    seqs = [rng.integers(0, 512, size=n) for n in lengths]
    teachers = draw(st.lists(st.sampled_from(NAMES), min_size=b, max_size=b))
    spans = None
    if draw(st.booleans()):
        spans = []
        for n in lengths:
            start = draw(st.integers(0, n))
            spans.append((start, draw(st.integers(start, n))))
    return {"seqs": seqs, "teachers": teachers, "spans": spans, "masked": draw(st.booleans())}


def _padded(seqs: list[np.ndarray], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), 257, dtype=torch.int64)
    mask = torch.zeros((len(seqs), t), dtype=torch.int64)
    for i, s in enumerate(seqs):
        cols = slice(t - len(s), t) if left else slice(0, len(s))
        ids[i, cols] = torch.from_numpy(s)
        mask[i, cols] = 1
    return ids, mask


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=routed_batches())
def test_random_routings_equal_each_teacher_asked_directly(
    clients: tuple[MultiTeacherClient, dict[str, TeacherClient]], case: dict[str, Any]
) -> None:
    multi, direct = clients
    seqs, teachers, spans = case["seqs"], case["teachers"], case["spans"]
    if case["masked"]:
        ids, mask = _padded(seqs, left=len(seqs) % 2 == 0)
        cols = None
        if spans is not None:  # the same ranges, as columns of the padded batch
            off = [int(m.argmax()) for m in mask]
            cols = [(a + o, b + o) for (a, b), o in zip(spans, off, strict=True)]
        got = multi.score(ids, K, teacher=teachers, attention_mask=mask, positions=cols)
        (streamed,) = multi.stream(
            [ScoreBatch(ids, positions=cols, attention_mask=mask, teacher=teachers)], K
        )
        for b, name in enumerate(teachers):
            want = direct[name].score(
                ids[b : b + 1],
                K,
                attention_mask=mask[b : b + 1],
                positions=None if cols is None else [cols[b]],
            )
            _assert_row_equal(got, b, want)
    else:
        got = multi.score(seqs, K, teacher=teachers, positions=spans)
        (streamed,) = multi.stream([ScoreBatch(seqs, positions=spans, teacher=teachers)], K)
        for b, name in enumerate(teachers):
            want = direct[name].score([seqs[b]], K, positions=None if spans is None else [spans[b]])
            _assert_row_equal(got, b, want)
    assert got.teachers == tuple(teachers)
    for a, c in zip(_fields(got, slice(None)), _fields(streamed, slice(None)), strict=True):
        assert torch.equal(a, c)


def test_stream_in_input_order_with_depth(
    clients: tuple[MultiTeacherClient, dict[str, TeacherClient]],
) -> None:
    """A stream of routed batches (one-teacher batches among them) comes back in input
    order, each batch equal to its score() answer; dtype and K pass through."""
    multi, _ = clients
    rng = np.random.default_rng(7)
    batches = []
    for i in range(9):
        seqs = [rng.integers(0, 512, size=int(rng.integers(4, 30))) for _ in range(3)]
        route = [NAMES[(i + j) % 2] for j in range(3)] if i % 3 else ["other"] * 3
        batches.append(ScoreBatch(seqs, teacher=route))
    out = list(multi.stream(batches, 4, depth=3, dtype="float32"))
    assert [p.teachers for p in out] == [tuple(b.teacher) for b in batches]
    for p, b in zip(out, batches, strict=True):
        want = multi.score(b.sequences, 4, teacher=b.teacher, dtype="float32")
        assert p.dtype == "float32" and p.top_k == 4
        assert torch.equal(p.ids, want.ids) and torch.equal(p.logprobs, want.logprobs)


def test_async_client_routes_concurrently(
    vllm_teacher: ServerProcess, other_teacher: ServerProcess
) -> None:
    async def run() -> TeacherPayload:
        targets = {"a": vllm_teacher.target, "b": {"target": other_teacher.target, "retries": 1}}
        async with AsyncMultiTeacherClient(targets, expect_vocab_size=512) as client:
            infos = await client.connect()
            assert set(infos) == {"a", "b"} and infos["b"].backend == "transformers"
            return await client.score([[1, 2, 3], [4, 5]], K, teacher=[1, 0])

    p = asyncio.run(run())
    assert p.teachers == ("b", "a") and p.lengths.tolist() == [3, 2]


def test_bad_routing_names_the_field(
    clients: tuple[MultiTeacherClient, dict[str, TeacherClient]],
) -> None:
    multi, _ = clients
    with pytest.raises(InvalidRequestError, match=r"teacher\[1\]: 'math' is not one of"):
        multi.score([[1, 2], [3, 4]], K, teacher=["vllm", "math"])
    with pytest.raises(InvalidRequestError, match="teacher: 1 names for 2 sequences"):
        multi.score([[1, 2], [3, 4]], K, teacher=["vllm"])
    with pytest.raises(InvalidRequestError, match="teacher: missing"):
        list(multi.stream([[[1, 2]]], K))
    assert multi.score([[1, 2]], K, teacher="other").teachers == ("other",)


def test_teacher_with_another_vocabulary_is_refused_at_connect(
    vllm_teacher: ServerProcess, tmp_path: Path, teacher_factory: Any
) -> None:
    """A teacher on a 640-token model: refused before the first request, naming it."""
    model = write_tiny_model(tmp_path / "wide", seed=2, vocab_size=640)
    wide = teacher_factory(["--backend", "transformers", "--model", str(model)])
    before = [requests_ok(s, "Score") for s in (vllm_teacher, wide)]
    with (
        MultiTeacherClient({"base": vllm_teacher.target, "wide": wide.target}) as client,
        pytest.raises(VocabMismatchError, match=r"teacher 'wide' \(127\.0\.0\.1:\d+\): vocab_size: 640"),
    ):
        client.score([[1, 2, 3]], K, teacher=["base"])
    assert [requests_ok(s, "Score") for s in (vllm_teacher, wide)] == before
    with (
        MultiTeacherClient(
            {"base": vllm_teacher.target, "wide": wide.target}, expect_vocab_size=512
        ) as client,
        pytest.raises(VocabMismatchError, match="teacher 'wide'.*the student expects 512"),
    ):
        client.connect()


def _info(**kw: Any) -> TeacherInfo:
    base: dict[str, Any] = dict(
        model_name="m", vocab_size=512, max_top_k=8, tokenizer_fingerprint="fp",
        schema_version=1, supported_dtypes=("float16",), backend="x",
        max_tokens_per_request=0, max_message_bytes=0, max_sequence_length=0,
    )  # fmt: skip
    return TeacherInfo(**{**base, **kw})


def test_agreement_rules() -> None:
    targets = {"a": ["h:1"], "b": ["h:2", "h:3"]}
    check_agreement({"a": _info(), "b": _info(model_name="other")}, targets)
    with pytest.raises(VocabMismatchError, match=r"teacher 'b' \(h:2, h:3\): tokenizer_fingerprint"):
        check_agreement({"a": _info(), "b": _info(tokenizer_fingerprint="zz")}, targets)
    with pytest.raises(TeacherMismatchError, match="teacher 'b'.*T = 2.*one temperature"):
        check_agreement({"a": _info(), "b": _info(teacher_temperature=2.0)}, targets)
    with pytest.raises(ValueError, match="teacher name"):
        MultiTeacherClient({"../x": "h:1"})
    with pytest.raises(ValueError, match=r"teachers\['a'\]: \['record_to'\] apply to every"):
        MultiTeacherClient({"a": {"target": "h:1", "record_to": "x"}})
