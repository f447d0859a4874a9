"""Scored arrays -> response messages: one message per request (Score) or row chunks
that stay under a byte budget (ScoreStream)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from teacher_server.backends.base import ScoredSequence
from topk_protocol import RequestOptions, encode_sequence, pb

__all__ = ["encode_scored", "iter_stream_responses"]


def encode_scored(
    scored: ScoredSequence,
    options: RequestOptions,
    *,
    sequence_index: int,
    rows: slice = slice(None),
) -> pb.SequencePayload:
    """Encode rows ``rows`` of one scored sequence (``[S, K]`` arrays) as a payload, in
    ``options``' dtype, with the sampled log-probs when ``options`` asks for them."""
    start = rows.start or 0
    return encode_sequence(
        scored.ids[rows],
        scored.logprobs[rows],
        scored.sampled_logprobs[rows] if options.include_sampled else None,
        dtype=options.wire_dtype,
        position_start=scored.position_start + start,
        sequence_index=sequence_index,
    )


def iter_stream_responses(
    request_id: str,
    scored: Sequence[ScoredSequence],
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
                    encode_scored(seq, options, sequence_index=index, rows=slice(done, done + take))
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
