"""The teacher's answer fingerprint: the canaries scored at start-up, announced in
``GetInfo`` and ``/v1/info``, and checked against a reference (``--expect-fingerprint``)
before the server reports ready (docs/fingerprint.md; the rules are
:mod:`topk_protocol.fingerprint`'s)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import numpy as np

from teacher_server.backends.base import Backend
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions
from topk_protocol.errors import NotRecordedError, TeacherMismatchError
from topk_protocol.fingerprint import (
    CANARY_LENGTH,
    CANARY_SEQUENCES,
    CANARY_TOP_K,
    AnswerFingerprint,
    canary_name,
    canary_sequences,
    differences,
    load_fingerprint,
    stated_drift,
)

__all__ = ["announce_fingerprint", "score_canaries"]

log = logging.getLogger(__name__)


async def score_canaries(backend: Backend) -> AnswerFingerprint | None:
    """The loaded ``backend``'s answers to the canaries (None for a backend that scores
    nothing of its own: replay). The sequences go in at once, as any requests would."""
    info = backend.info
    length = CANARY_LENGTH
    if info.max_sequence_length:
        length = min(length, info.max_sequence_length)
    k = min(CANARY_TOP_K, info.max_top_k, info.vocab_size)
    sequences = canary_sequences(info.vocab_size, CANARY_SEQUENCES, length)
    try:
        answers = await asyncio.gather(
            *(
                backend.score(ParsedSequence(s, 0, len(s)), RequestOptions(top_k=k))
                for s in sequences
            )
        )
    except NotRecordedError:
        return None
    return AnswerFingerprint(
        canary=canary_name(CANARY_SEQUENCES, length),
        ids=np.concatenate([a.ids for a in answers]).astype(np.int32),
        logprobs=np.concatenate([a.logprobs for a in answers]).astype(np.float32),
        drift=stated_drift(info.dtype),
        engine_dtype=info.dtype,
        model_name=info.model_name,
    )


async def announce_fingerprint(backend: Backend, expect: str | Path | None = None) -> None:
    """Score the canaries and put the fingerprint in ``backend.info`` (what ``GetInfo``
    announces). With ``expect`` (a reference file, :func:`load_fingerprint`): raise
    :class:`TeacherMismatchError` naming the model, dtype and what differs unless the
    answers agree, so that the server fails instead of becoming ready. The reference is
    read first: a file that does not parse fails before the canaries are scored."""
    reference = None if expect is None else load_fingerprint(expect)
    fingerprint = await score_canaries(backend)
    if fingerprint is None:
        if reference is not None:
            raise TeacherMismatchError(
                f"expect_fingerprint {expect}: the {backend.info.name} backend scores no "
                "canaries of its own, so it cannot be checked"
            )
        return
    backend.info = dataclasses.replace(backend.info, answer_fingerprint=fingerprint)
    if reference is not None:
        problems = differences(fingerprint, reference)
        if problems:
            raise TeacherMismatchError(
                f"expect_fingerprint {expect}: this teacher (model "
                f"{fingerprint.model_name!r}, dtype {fingerprint.engine_dtype or 'none'}) "
                f"does not answer like the reference (model {reference.model_name!r}, dtype "
                f"{reference.engine_dtype or 'none'}): " + "; ".join(problems)
            )
        log.info("answer fingerprint agrees with %s", expect)
