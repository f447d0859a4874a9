"""The HTTP calls Hugging Face TRL's teacher client makes, answered from our backends.

TRL's ``VLLMClient.get_sequence_logprobs`` (docs/trl.md) posts, depending on its version:

- TRL 1.11 and later: vLLM's ``POST /v1/completions`` with token-id prompts,
  ``max_tokens=1``, ``temperature`` and ``prompt_logprobs=K``; served by vLLM's route
  (:mod:`teacher_server.http_api.vllm`), which other frameworks call too.
- TRL 1.10: its own ``POST /get_sequence_logprobs/`` with ``sequences``,
  ``prompt_lengths``, ``top_logprobs``, ``temperature`` and ``response_format`` (``json``:
  nested lists; ``binary``: base64 float32/int32 arrays padded with ``-inf`` / 0),
  served here; and vLLM's ``GET /v1/models``, which TRL's client reads first.

Each request becomes one ``ScoreRequest`` (float32, the rows :func:`trl_span` says) that
goes through the request pipeline like a gRPC ``Score`` (:mod:`teacher_server.pipeline`,
:func:`teacher_server.http_api.scoring.score_body`): lifecycle, validation, admission,
backend (vLLM, transformers or replay), metrics. The answer is rendered in TRL's layout
(:mod:`topk_protocol.trl_layout`) in a worker thread. A request ``temperature`` other
than the served one is refused (a top-k answer cannot be re-tempered); a field TRL's
``SequenceLogprobsRequest`` does not declare is accepted and ignored, as TRL's pydantic
model ignores it (:data:`SEQUENCE_RULES`, the routes' one rule). Refusals are the
protocol's typed errors with the field named; the pipeline maps them to a transport-free
status, and :func:`teacher_server.http_api.answers.http_status` that status to HTTP, once.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.http_api.answers import HTTPAnswer
from teacher_server.http_api.bodies import (
    FieldRules,
    IgnoredField,
    check_temperature,
    int_field,
    invalid,
    json_object,
    token_id_lists,
)
from teacher_server.http_api.scoring import score_body
from teacher_server.pipeline import RequestPipeline
from teacher_server.validation import Limits
from topk_protocol import SequenceArrays, encode_token_ids, pb
from topk_protocol.checks import check_top_k
from topk_protocol.codes import Status
from topk_protocol.errors import TeacherError
from topk_protocol.trl_layout import (
    JSON_NEG_INF,
    TRLRows,
    check_prompt_lengths,
    trl_rows,
    trl_span,
)

__all__ = [
    "SEQUENCE_LOGPROBS_METHOD",
    "SEQUENCE_RULES",
    "TRLEndpoints",
]

#: Metric label (``method``) of TRL 1.10's route (TRL 1.11+'s ``/v1/completions`` is
#: vLLM's: :mod:`teacher_server.http_api.vllm`).
SEQUENCE_LOGPROBS_METHOD = "HTTP /get_sequence_logprobs"

#: The body of TRL 1.10's route (``SequenceLogprobsRequest`` in ``trl/scripts/vllm_serve.py``,
#: a pydantic model: it declares these five, all read here, and ignores any other key).
SEQUENCE_RULES = FieldRules(
    stock="TRL's SequenceLogprobsRequest",
    read=frozenset(
        {"sequences", "prompt_lengths", "top_logprobs", "temperature", "response_format"}
    ),
)
_RESPONSE_FORMATS = ("json", "binary")
#: TRL 1.10's default ``top_logprobs`` when a request leaves it out.
TRL_DEFAULT_TOP_LOGPROBS = 100


def _score_request(
    seqs: list[npt.NDArray[np.int32]], spans: list[tuple[int, int]], top_k: int
) -> pb.ScoreRequest:
    req = pb.ScoreRequest(
        request_id=uuid.uuid4().hex[:12], top_k=top_k, dtype=pb.LOGPROB_DTYPE_FLOAT32
    )
    for ids, (start, end) in zip(seqs, spans, strict=True):
        req.sequences.add(token_ids=encode_token_ids(ids), position_start=start, position_end=end)
    return req


@dataclass(frozen=True)
class _Parsed:
    """A TRL request, checked: the sequences, TRL's prompt lengths and K."""

    sequences: list[npt.NDArray[np.int32]]
    prompt_lengths: list[int]
    top_k: int
    response_format: str = "json"
    ignored_fields: tuple[IgnoredField, ...] = ()

    def score_request(self) -> pb.ScoreRequest:
        spans = [
            trl_span(len(s), p) for s, p in zip(self.sequences, self.prompt_lengths, strict=True)
        ]
        return _score_request(self.sequences, spans, self.top_k)


def parse_sequence_logprobs(data: dict[str, Any], info: pb.TeacherInfo, limits: Limits) -> _Parsed:
    """A TRL 1.10 ``/get_sequence_logprobs/`` body -> the completion positions."""
    ignored = SEQUENCE_RULES.apply(data)
    top_k = int_field(data, "top_logprobs", TRL_DEFAULT_TOP_LOGPROBS)
    check_top_k(top_k, limits, "top_logprobs")
    fmt = data.get("response_format", "json")
    if fmt not in _RESPONSE_FORMATS:
        raise invalid(f"response_format: {json.dumps(fmt)[:40]} is not one of json, binary")
    check_temperature(data, info.teacher_temperature)
    seqs = token_id_lists(data.get("sequences"), "sequences", limits)
    lengths = check_prompt_lengths(data.get("prompt_lengths"), [len(s) for s in seqs])
    return _Parsed(seqs, lengths, top_k, fmt, tuple(ignored))


# -- answers -------------------------------------------------------------------------------
def rows_of(parsed: _Parsed, scored: list[SequenceArrays]) -> list[TRLRows]:
    """The scored sequences in TRL's alignment (one :class:`TRLRows` each). The routes
    ask for sampled log-probs, so every backend gives them."""
    rows = []
    for s, ids, p in zip(scored, parsed.sequences, parsed.prompt_lengths, strict=True):
        if s.sampled_logprobs is None:
            raise TeacherError("teacher: the backend gave no sampled log-probs")
        rows.append(trl_rows(s.ids, s.logprobs, s.sampled_logprobs, ids, p))
    return rows


def _clamped(values: npt.NDArray[np.float32]) -> list[float]:
    """Python floats, ``-inf`` written as vLLM's JSON does (:data:`JSON_NEG_INF`)."""
    if np.isneginf(values).any():
        values = np.where(np.isneginf(values), np.float32(JSON_NEG_INF), values)
    out: list[float] = values.tolist()
    return out


def _entries(rows: TRLRows) -> list[tuple[list[int], list[float]]]:
    """Per row (position 0 excluded): the ids and log-probs of vLLM's prompt log-prob
    entry, sorted by rank: the top K, then the prompt token when it is not among them."""
    skip = 1 if rows.has_first else 0
    ids: list[list[int]] = rows.token_ids[skip:].tolist()
    lps: list[list[float]] = _clamped(rows.logprobs[skip:])  # type: ignore[assignment]
    actual: list[int] = rows.actual_token_ids[skip:].tolist()
    actual_lp = _clamped(rows.actual_logprobs[skip:])
    out: list[tuple[list[int], list[float]]] = []
    for row_ids, row_lps, tok, lp in zip(ids, lps, actual, actual_lp, strict=True):
        if tok not in row_ids:
            row_ids = [*row_ids, tok]
            row_lps = [*row_lps, lp]
        out.append((row_ids, row_lps))
    return out


def render_sequence_logprobs(parsed: _Parsed, scored: list[SequenceArrays]) -> bytes:
    """TRL 1.10's answer, in the request's ``response_format``."""
    rows = rows_of(parsed, scored)
    if parsed.response_format == "json":
        logprobs: list[list[list[float]]] = []
        token_ids: list[list[list[int]]] = []
        for r in rows:
            first: list[list[Any]] = [[]] if r.has_first else []
            pairs = _entries(r)
            logprobs.append(first + [lp for _, lp in pairs])
            token_ids.append(first + [ids for ids, _ in pairs])
        return json.dumps({"logprobs": logprobs, "logprob_token_ids": token_ids}).encode()
    lengths = [r.num_rows for r in rows]
    shape = [len(rows), max(lengths, default=0), parsed.top_k]
    lps = np.full(shape, -np.inf, np.float32)
    ids = np.zeros(shape, np.int32)
    act = np.full((*shape[:2], 1), -np.inf, np.float32)
    act_ids = np.zeros((*shape[:2], 1), np.int32)
    for i, r in enumerate(rows):
        c = r.num_rows
        lps[i, :c] = r.logprobs
        ids[i, :c] = r.token_ids
        act[i, :c, 0] = r.actual_logprobs
        act_ids[i, :c, 0] = r.actual_token_ids
        if r.has_first:
            act_ids[i, 0, 0] = 0  # TRL 1.10 leaves position 0 (no distribution) at 0

    def b64(a: npt.NDArray[Any]) -> str:
        return base64.b64encode(a.tobytes()).decode("ascii")

    body = {
        "logprobs_b64": b64(lps),
        "token_ids_b64": b64(ids),
        "actual_logprobs_b64": b64(act),
        "actual_token_ids_b64": b64(act_ids),
        "shape": shape,
        "completion_lengths": lengths,
    }
    return json.dumps(body).encode()


class TRLEndpoints:
    """The two routes' logic: body bytes in, :class:`HTTPAnswer` out.

    Args:
        pipeline: the request pipeline ``Score`` runs through (lifecycle, validation,
            admission, backend, metrics); a body is parsed, and its answer rendered, in a
            worker thread.
        info: the teacher's ``TeacherInfo`` once loaded.
    """

    def __init__(
        self, pipeline: RequestPipeline, info: Callable[[], pb.TeacherInfo | None]
    ) -> None:
        self._pipeline = pipeline
        self._info = info

    async def _answer(
        self,
        body: bytes,
        method: str,
        parse: Callable[[dict[str, Any], pb.TeacherInfo, Limits], _Parsed],
        render: Callable[[_Parsed, list[SequenceArrays]], bytes],
    ) -> HTTPAnswer:
        return await score_body(
            self._pipeline,
            self._info,
            method,
            body,
            lambda raw, info, limits: parse(json_object(raw), info, limits),
            lambda parsed, scored, _seconds: render(parsed, scored),
            lambda refused: HTTPAnswer.refused(refused.code, refused.message),
        )

    def models(self) -> HTTPAnswer:
        """vLLM's ``GET /v1/models``: the served model (TRL's client reads its id)."""
        info = self._info()
        if info is None:
            return HTTPAnswer.refused(Status.UNAVAILABLE, "teacher: loading")
        card = {
            "id": info.model_name,
            "object": "model",
            "owned_by": "topk-distill",
            "max_model_len": info.max_sequence_length or None,
        }
        return HTTPAnswer(200, json.dumps({"object": "list", "data": [card]}).encode())

    async def sequence_logprobs(self, body: bytes) -> HTTPAnswer:
        """``POST /get_sequence_logprobs/`` (TRL 1.10)."""
        return await self._answer(
            body, SEQUENCE_LOGPROBS_METHOD, parse_sequence_logprobs, render_sequence_logprobs
        )
