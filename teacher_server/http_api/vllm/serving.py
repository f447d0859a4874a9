"""vLLM's ``/v1/completions`` and ``/inference/v1/generate`` through the request
pipeline, answered in vLLM's layout.

Each request is scored as one ``ScoreRequest``
(:func:`teacher_server.http_api.scoring.score_body`: lifecycle, validation, admission,
backend, metrics, as gRPC ``Score``) and rendered here in a worker thread:

- ``prompt_logprobs``: per prompt ``[null, {entry 1}, ..., {entry L-1}]``, entry ``p``
  ``{"<id>": {"logprob": v, "rank": r}, ...}`` in vLLM's order: the prompt token
  ``x[p]`` first with its rank, then the top K in rank order (without ``x[p]`` again).
  With ``decoded`` (text prompts, ``echo``) each also carries vLLM's ``decoded_token``.
- ``/v1/completions`` with ``echo``: ``text`` is the prompt's text, and with
  ``logprobs=N`` the choice's ``logprobs`` covers the prompt as vLLM's does
  (``tokens``, ``token_logprobs`` with ``null`` first, ``top_logprobs`` keyed by token
  text, the prompt token and the top N, ``text_offset``). Nothing is generated:
  ``completion_tokens`` 0, ``finish_reason`` ``length``.
- ``/inference/v1/generate``: vLLM's ``GenerateTokensResponse`` with one choice of no
  ``token_ids`` and the prompt's ``prompt_logprobs``.

``prompt_logprobs`` is written from the arrays by
:mod:`teacher_server.http_api.json_arrays` (no Python object per entry; each log-prob
the shortest decimal that reads back as the same float32, a ``decoded_token`` from a
table of the answer's distinct ids). A ``-inf`` log-prob is written -9999.0, as vLLM
does. A prompt token's rank is its true rank in the teacher's distribution (the engine
counts it, as vLLM's does: ``SequenceArrays.sampled_ranks``); where it is also one of the
top K, its place there, as in vLLM's answer. A backend that does not know it (a replayed
recording) gives K + 1 for a token outside the top K.
Refusals: ``/v1/completions`` keeps the shape TRL's client has read since the route
came (``{"error": message, "code": "<status>"}``); ``/inference/v1/generate`` answers
vLLM's ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.http_api.answers import HTTPAnswer, http_status
from teacher_server.http_api.bodies import invalid, json_object
from teacher_server.http_api.json_arrays import (
    Cells,
    concat,
    joined,
    json_floats,
    json_ints,
    json_lists,
)
from teacher_server.http_api.scoring import score_body
from teacher_server.http_api.text import LazyTokenTexts, TokenTexts
from teacher_server.http_api.vllm.protocol import (
    PromptLogprobsRequest,
    parse_completions,
    parse_token_generate,
)
from teacher_server.pipeline import Refused, RequestPipeline
from teacher_server.validation import Limits
from topk_protocol import SequenceArrays, pb
from topk_protocol.errors import TeacherError
from topk_protocol.trl_layout import JSON_NEG_INF

__all__ = [
    "COMPLETIONS_METHOD",
    "TOKEN_GENERATE_METHOD",
    "PromptEntries",
    "VLLMEndpoints",
    "prompt_entries",
    "render_completions",
    "render_token_generate",
    "vllm_error",
]

#: Metric labels (``method``) of the two routes.
COMPLETIONS_METHOD = "HTTP /v1/completions"
TOKEN_GENERATE_METHOD = "HTTP /inference/v1/generate"


@dataclass(frozen=True)
class PromptEntries:
    """One prompt's vLLM entries 1 .. L-1, in vLLM's order, as ``[S, 1 + k]`` arrays:
    column 0 the prompt token, then the top ``k`` by rank; ``keep`` false where a top
    id is the prompt token (written once, first)."""

    ids: npt.NDArray[np.int32]
    lps: npt.NDArray[np.float32]
    ranks: npt.NDArray[np.int32]
    keep: npt.NDArray[np.bool_]


def prompt_entries(tokens: npt.NDArray[np.int32], scored: SequenceArrays, k: int) -> PromptEntries:
    """vLLM's entries of a prompt ``tokens`` ``[L]`` from its scored rows ``[0, L - 1)``
    (``scored``, engine K columns): entry ``p`` = our row ``p - 1``, the prompt token
    ``x[p]`` first, then the top ``k`` (``k <= K``) without it. The prompt token's rank:
    its place among the K when it is one of them (vLLM's answer keeps that one), else
    ``scored.sampled_ranks`` (K + 1 where the backend gave none)."""
    if scored.sampled_logprobs is None:
        raise TeacherError("teacher: the backend gave no actual-token log-probs")
    actual = np.asarray(tokens[1:], dtype=np.int32)[:, None]
    hit = scored.ids == actual
    first = hit.argmax(axis=1) if scored.top_k else np.zeros(len(actual), dtype=np.intp)
    below = scored.top_k + 1 if scored.sampled_ranks is None else scored.sampled_ranks
    rank = np.where(hit.any(axis=1), first + 1, below)
    top_ids = scored.ids[:, :k]
    rows, width = top_ids.shape
    top_ranks = np.broadcast_to(np.arange(1, width + 1, dtype=np.int32), (rows, width))
    return PromptEntries(
        ids=np.concatenate([actual, top_ids], axis=1),
        lps=np.concatenate([scored.sampled_logprobs[:, None], scored.logprobs[:, :k]], axis=1),
        ranks=np.concatenate([rank[:, None].astype(np.int32), top_ranks], axis=1),
        keep=np.concatenate([np.ones((rows, 1), dtype=np.bool_), top_ids != actual], axis=1),
    )


def _prompt_logprobs_json(entries: PromptEntries, texts: TokenTexts | None) -> bytes:
    """``[null, {...}, ...]`` (vLLM's ``prompt_logprobs`` of one prompt)."""
    if entries.ids.shape[0] == 0:
        return b"[null]"
    pieces: list[Cells | bytes] = [
        b'"',
        json_ints(entries.ids.reshape(-1)),
        b'":{"logprob":',
        json_floats(entries.lps.reshape(-1), nonfinite=JSON_NEG_INF),
        b',"rank":',
        json_ints(entries.ranks.reshape(-1)),
    ]
    if texts is not None:
        pieces += [b',"decoded_token":', texts.json_cells(entries.ids)]
    rows = json_lists(concat(*pieces, b"}"), entries.keep, brackets=(b"{", b"}"))
    return b"[null," + joined(rows) + b"]"


def _finite(values: npt.NDArray[np.float32]) -> list[Any]:
    """Python floats (nested lists of them for ``[S, W]``), a non-finite one as
    JSON_NEG_INF."""
    out: list[Any] = np.where(np.isfinite(values), values, np.float32(JSON_NEG_INF)).tolist()
    return out


def _echo_logprobs(
    tokens: npt.NDArray[np.int32], entries: PromptEntries, n: int, texts: TokenTexts
) -> dict[str, Any]:
    """vLLM's completion ``logprobs`` of an echoed prompt with ``logprobs=n``: per
    position the prompt token and the top ``n`` (the first ``n + 1`` entries)."""
    token_texts = [texts.text(t) for t in tokens.tolist()]
    token_logprobs: list[float | None] = [None, *_finite(entries.lps[:, 0])]
    top: list[dict[str, float] | None] = [None]
    # The first n + 1 kept entries lie in the first n + 2 columns (one at most is not kept).
    cols = slice(0, n + 2)
    for ids, lps, keep in zip(
        entries.ids[:, cols].tolist(),
        _finite(entries.lps[:, cols]),
        entries.keep[:, cols].tolist(),
        strict=True,
    ):
        kept = [(t, v) for t, v, k in zip(ids, lps, keep, strict=True) if k][: n + 1]
        top.append({texts.text(t): v for t, v in kept})
    offsets, at = [], 0
    for text in token_texts:
        offsets.append(at)
        at += len(text)
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": token_texts,
        "top_logprobs": top,
    }


_NO_LOGPROBS: dict[str, list[Any]] = {
    "text_offset": [],
    "token_logprobs": [],
    "tokens": [],
    "top_logprobs": [],
}


def render_completions(
    request: PromptLogprobsRequest,
    scored: list[SequenceArrays],
    model: str,
    texts: TokenTexts | None,
) -> bytes:
    """vLLM's ``/v1/completions`` answer (one choice per prompt); ``texts``: the token
    texts (needed when ``request.decoded``)."""
    table = texts if request.decoded else None
    k = request.prompt_k if request.prompt_k is not None else 0
    choices = []
    for index, (tokens, text, arrays) in enumerate(
        zip(request.sequences, request.texts, scored, strict=True)
    ):
        entries = prompt_entries(tokens, arrays, k)
        prompt_lp = b"null"
        if request.prompt_k is not None:
            prompt_lp = _prompt_logprobs_json(entries, table)
        logprobs: Any = None
        out_text = ""
        if request.echo:
            if texts is None:
                raise TeacherError("teacher: echo needs the backend's tokenizer")
            out_text = text if text is not None else texts.decode(tokens)
            if request.logprobs is not None:
                logprobs = _echo_logprobs(tokens, entries, request.logprobs, texts)
        elif request.logprobs is not None:
            logprobs = _NO_LOGPROBS
        choice = (
            f'{{"index":{index},"text":{json.dumps(out_text, ensure_ascii=False)},'
            f'"logprobs":{json.dumps(logprobs, ensure_ascii=False)},"finish_reason":"length",'
            f'"stop_reason":null,"prompt_logprobs":'
        )
        choices.append(choice.encode() + prompt_lp + b"}")
    n = sum(len(s) for s in request.sequences)
    head = json.dumps(
        {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
        }
    )[:-1]
    usage = json.dumps({"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0})
    return f'{head},"choices":['.encode() + b",".join(choices) + f'],"usage":{usage}}}'.encode()


def render_token_generate(
    request: PromptLogprobsRequest, scored: list[SequenceArrays], model: str
) -> bytes:
    """vLLM's ``/inference/v1/generate`` answer (``output_mode`` tokens)."""
    (tokens,), (arrays,) = request.sequences, scored
    k = request.prompt_k or 0
    entries = prompt_entries(tokens, arrays, k)
    prompt_lp = _prompt_logprobs_json(entries, None)
    n = len(tokens)
    head = json.dumps(
        {
            "request_id": request.request_id,
            "model": model,
            "created": int(time.time()),
            "output_mode": "tokens",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "token_ids": [],
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0},
            "kv_transfer_params": None,
        }
    )[:-1]
    return f'{head},"prompt_logprobs":'.encode() + prompt_lp + b"}"


def vllm_error(status: int, message: str) -> HTTPAnswer:
    """vLLM's error answer: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return HTTPAnswer(status, json.dumps(body).encode())


class VLLMEndpoints:
    """``POST /v1/completions`` and ``POST /inference/v1/generate``: body bytes in,
    :class:`HTTPAnswer` out (the backend's tokenizer encodes text prompts and writes
    token texts)."""

    def __init__(
        self, pipeline: RequestPipeline, info: Callable[[], pb.TeacherInfo | None]
    ) -> None:
        self._pipeline = pipeline
        self._info = info
        self._texts = LazyTokenTexts(pipeline.backend)

    def _model(self) -> str:
        info = self._info()
        return info.model_name if info else ""

    async def completions(self, body: bytes, client: Hashable = None) -> HTTPAnswer:
        """``POST /v1/completions``."""
        texts = self._texts.get()

        def parse(raw: bytes, info: pb.TeacherInfo, limits: Limits) -> PromptLogprobsRequest:
            tokenizer = self._pipeline.backend.tokenizer
            parsed = parse_completions(json_object(raw), info, limits, tokenizer)
            if parsed.decoded and texts is None:
                raise invalid(
                    "echo: this teacher's backend has no tokenizer to write the prompt's "
                    "text and tokens; send token ids without echo"
                )
            return parsed

        def render(parsed: PromptLogprobsRequest, scored: list[SequenceArrays], _: float) -> bytes:
            return render_completions(parsed, scored, self._model(), texts)

        def refuse(refused: Refused) -> HTTPAnswer:
            return HTTPAnswer.refused(refused.code, refused.message)

        return await score_body(
            self._pipeline, self._info, COMPLETIONS_METHOD, body, parse, render, refuse, client
        )

    async def token_generate(self, body: bytes, client: Hashable = None) -> HTTPAnswer:
        """``POST /inference/v1/generate``."""

        def parse(raw: bytes, info: pb.TeacherInfo, limits: Limits) -> PromptLogprobsRequest:
            return parse_token_generate(json_object(raw), info, limits)

        def render(parsed: PromptLogprobsRequest, scored: list[SequenceArrays], _: float) -> bytes:
            return render_token_generate(parsed, scored, self._model())

        def refuse(refused: Refused) -> HTTPAnswer:
            return vllm_error(http_status(refused.code), refused.message)

        return await score_body(
            self._pipeline, self._info, TOKEN_GENERATE_METHOD, body, parse, render, refuse, client
        )
