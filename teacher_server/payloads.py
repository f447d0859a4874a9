"""Scored arrays -> response messages: one message per request (Score) or row chunks
that stay under a byte budget (ScoreStream)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from topk_protocol import RequestOptions, SequenceArrays, encode_sequence, pb

__all__ = ["encode_scored", "iter_stream_responses"]


def encode_scored(
    scored: SequenceArrays, options: RequestOptions, *, sequence_index: int
) -> pb.SequencePayload:
    """Encode one scored sequence (or a chunk of its rows) as a payload, in ``options``'
    dtype, with the sampled log-probs only when ``options`` asks for them."""
    if not options.include_sampled and scored.sampled_logprobs is not None:
        scored = replace(scored, sampled_logprobs=None)
    return encode_sequence(scored, dtype=options.wire_dtype, sequence_index=sequence_index)


def iter_stream_responses(
    request_id: str,
    scored: Sequence[SequenceArrays],
    options: RequestOptions,
    *,
    chunk_bytes: int,
    teacher_seconds: float = 0.0,
) -> Iterator[pb.ScoreResponse]:
    """Pack all sequences' rows, in order, into messages of at most ``chunk_bytes`` of
    payload arrays (at least one row each). Sequences with no rows still get an empty
    piece, so the client sees every sequence. The last message has ``final`` set."""
    budget_rows = max(1, chunk_bytes // options.bytes_per_row())
    msg = pb.ScoreResponse(request_id=request_id)
    room = budget_rows
    for index, seq in enumerate(scored):
        n = len(seq.ids)
        done = 0
        while True:
            take = min(n - done, room)
            if take > 0 or n == 0:
                msg.sequences.append(
                    encode_scored(seq.rows(done, done + take), options, sequence_index=index)
                )
            done += take
            room -= take
            if done >= n:
                break
            # This message is full: send it and start the next one.
            yield msg
            msg = pb.ScoreResponse(request_id=request_id)
            room = budget_rows
    msg.final = True
    msg.teacher_seconds = teacher_seconds
    yield msg
