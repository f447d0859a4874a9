"""Fake teacher answers and the teacher's own encoding of them, shared by the recording and
replay-backend tests: a recording made from these must replay byte-identically to what the
servicer would send."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from student_client.data.assembler import ResponseAssembler
from student_client.data.payload import TeacherPayload
from teacher_server.grpc_api.answers import iter_stream_responses
from topk_protocol import RequestOptions, SequenceArrays, build_request, pb, request_spans

__all__ = ["INFO", "K", "assert_bit_equal", "live_payload", "teacher_answer"]

INFO = pb.TeacherInfo(
    model_name="fake",
    vocab_size=512,
    max_top_k=64,
    tokenizer_fingerprint="ab" * 32,
    schema_version=1,
    backend="test",
)
K = 16


def teacher_answer(n: int, seed: int) -> tuple[np.ndarray, SequenceArrays]:
    """A sequence of n tokens and a float32 teacher answer for all its positions."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 512, size=n).astype(np.int32)
    ids = np.argsort(rng.random((n, 512)), axis=1)[:, :K].astype(np.int32)
    lps = -np.sort(rng.exponential(2.0, (n, K)).astype(np.float32), axis=1)
    sampled = -rng.exponential(2.0, n).astype(np.float32)
    sampled[-1] = np.nan
    return tokens, SequenceArrays(ids, lps, sampled, 0)


def live_payload(
    corpus: dict[bytes, SequenceArrays], seqs: list[np.ndarray], k: int, **kwargs: Any
) -> TeacherPayload:
    """What the teacher would answer: the servicer's own slicing and encoding (streamed in
    small chunks), decoded by the client's assembler."""
    req = build_request(seqs, k, request_id="live", **kwargs)
    scored = []
    for seq, (s, e) in zip(req.sequences, request_spans(req), strict=True):
        scored.append(corpus[seq.token_ids].positions(s, e).top(k))
    asm = ResponseAssembler(req)
    for msg in iter_stream_responses(
        "live",
        scored,
        RequestOptions.from_proto(req),
        chunk_bytes=300,
        vocab_size=int(INFO.vocab_size),
    ):
        asm.add(msg)
    return asm.payload()


def assert_bit_equal(a: TeacherPayload, b: TeacherPayload) -> None:
    assert a.dtype == b.dtype and a.top_k == b.top_k
    for x, y in ((a.ids, b.ids), (a.mask, b.mask), (a.position_start, b.position_start)):
        assert torch.equal(x, y)
    assert torch.equal(a.logprobs.view(torch.int32), b.logprobs.view(torch.int32))
    if a.sampled_logprobs is None or b.sampled_logprobs is None:
        assert a.sampled_logprobs is None and b.sampled_logprobs is None
    else:
        assert torch.equal(
            a.sampled_logprobs.view(torch.int32), b.sampled_logprobs.view(torch.int32)
        )
