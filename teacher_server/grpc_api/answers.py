"""Scored arrays -> the answer messages of the gRPC methods, serialized ready to send.

``Score`` answers every sequence in one ``ScoreResponse`` (:func:`encode_response`);
``ScoreStream`` packs the rows, in order, into messages that stay under a byte budget
(:func:`iter_stream_responses`, :func:`encode_stream`). Pure and synchronous: the request
pipeline (:mod:`teacher_server.pipeline`) runs them in a worker thread for large
requests, so the answers leave serialized (the handlers' serializer passes bytes through:
:mod:`teacher_server.grpc_api.handlers`), and gRPC has nothing left to do on the event loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from teacher_server.alignment import RowKind
from teacher_server.validation import ParsedRequest
from topk_protocol import RequestOptions, SequenceArrays, encode_sequence, pb

__all__ = [
    "Outgoing",
    "count_rows",
    "encode_response",
    "encode_scored",
    "encode_stream",
    "iter_stream_responses",
]


@dataclass(frozen=True)
class Outgoing:
    """One serialized ``ScoreResponse`` of a stream; ``final``: its request's last."""

    message: bytes
    final: bool


def encode_scored(
    scored: SequenceArrays,
    options: RequestOptions,
    *,
    sequence_index: int,
    vocab_size: int = 0,
) -> pb.SequencePayload:
    """Encode one scored sequence (or a chunk of its rows) as a payload, in ``options``'
    dtype and encoding (a packed one needs the teacher's ``vocab_size``: its ids'
    width), with the sampled log-probs only when ``options`` asks for them."""
    if not options.include_sampled and scored.sampled_logprobs is not None:
        scored = replace(scored, sampled_logprobs=None)
    packing = options.packing(vocab_size) if options.logprob_bits is not None else None
    return encode_sequence(
        scored, dtype=options.wire_dtype, sequence_index=sequence_index, packing=packing
    )


def count_rows(msg: pb.ScoreResponse, rows: SequenceArrays) -> None:
    """Add the rows of a student tokenizer's answer (``rows.row_kinds``) to the message's
    ``row_counts``; nothing for any other answer."""
    if rows.row_kinds is None:
        return
    counts = np.bincount(rows.row_kinds, minlength=len(RowKind))
    msg.row_counts.aligned += int(counts[RowKind.ALIGNED])
    msg.row_counts.boundary += int(counts[RowKind.BOUNDARY])
    msg.row_counts.masked += int(counts[RowKind.MASKED])


def encode_response(
    parsed: ParsedRequest, scored: Sequence[SequenceArrays], teacher_seconds: float
) -> bytes:
    """The ``Score`` answer: every sequence of ``parsed`` in one final message."""
    msg = pb.ScoreResponse(
        request_id=parsed.request_id,
        sequences=[
            encode_scored(s, parsed.options, sequence_index=i, vocab_size=parsed.vocab_size)
            for i, s in enumerate(scored)
        ],
        final=True,
        teacher_seconds=teacher_seconds,
    )
    for s in scored:
        count_rows(msg, s)
    return msg.SerializeToString()


def iter_stream_responses(
    request_id: str,
    scored: Sequence[SequenceArrays],
    options: RequestOptions,
    *,
    chunk_bytes: int,
    teacher_seconds: float = 0.0,
    vocab_size: int = 0,
) -> Iterator[pb.ScoreResponse]:
    """Pack all sequences' rows, in order, into messages of at most ``chunk_bytes`` of
    payload arrays (at least one row each; a row's bytes count its candidates).
    Sequences with no rows still get an empty piece, so the client sees every sequence.
    The last message has ``final`` set. ``vocab_size``: the teacher's (a packed answer's
    id width)."""
    msg = pb.ScoreResponse(request_id=request_id)
    room = chunk_bytes
    for index, seq in enumerate(scored):
        n = len(seq.ids)
        per_row = options.bytes_per_row(vocab_size, seq.num_candidates)
        done = 0
        while True:
            fit = 1 if room == chunk_bytes else 0  # a message holds at least one row
            take = min(n - done, max(room // per_row, fit))
            if take > 0 or n == 0:
                chunk = seq.rows(done, done + take)
                msg.sequences.append(
                    encode_scored(chunk, options, sequence_index=index, vocab_size=vocab_size)
                )
                count_rows(msg, chunk)
            done += take
            room -= take * per_row
            if done >= n:
                break
            # This message is full: send it and start the next one.
            yield msg
            msg = pb.ScoreResponse(request_id=request_id)
            room = chunk_bytes
    msg.final = True
    msg.teacher_seconds = teacher_seconds
    yield msg


def encode_stream(
    parsed: ParsedRequest,
    scored: Sequence[SequenceArrays],
    teacher_seconds: float,
    *,
    chunk_bytes: int,
) -> list[Outgoing]:
    """The ``ScoreStream`` answer to one request: :func:`iter_stream_responses`,
    serialized."""
    return [
        Outgoing(m.SerializeToString(), m.final)
        for m in iter_stream_responses(
            parsed.request_id,
            scored,
            parsed.options,
            chunk_bytes=chunk_bytes,
            teacher_seconds=teacher_seconds,
            vocab_size=parsed.vocab_size,
        )
    ]
