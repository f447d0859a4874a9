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

A ``-inf`` log-prob is written -9999.0, as vLLM does. The rank of a prompt token outside
the top K the engine was asked for is K + 1 (the teacher knows only that it is below).
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
from teacher_server.http_api.scoring import score_body
from teacher_server.http_api.text import TokenTexts
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


def _floats(values: npt.NDArray[np.float32]) -> list[float]:
    if not np.isfinite(values).all():
        values = np.where(np.isfinite(values), values, np.float32(JSON_NEG_INF))
    out: list[float] = values.tolist()
    return out


@dataclass(frozen=True)
class PromptEntries:
    """One prompt's vLLM entries 1 .. L-1, in vLLM's order: per entry the ids, their
    log-probs and ranks (the prompt token first)."""

    ids: list[list[int]]
    lps: list[list[float]]
    ranks: list[list[int]]


def prompt_entries(tokens: npt.NDArray[np.int32], scored: SequenceArrays, k: int) -> PromptEntries:
    """vLLM's entries of a prompt ``tokens`` ``[L]`` from its scored rows ``[0, L - 1)``
    (``scored``, engine K columns): entry ``p`` = our row ``p - 1``, the prompt token
    ``x[p]`` first, then the top ``k`` (``k <= K``) without it."""
    if scored.sampled_logprobs is None:
        raise TeacherError("teacher: the backend gave no actual-token log-probs")
    engine_k = scored.ids.shape[1] if scored.ids.ndim == 2 else k
    row_ids: list[list[int]] = scored.ids.tolist()
    row_lps: list[list[float]] = _floats(scored.logprobs)  # type: ignore[assignment]
    actual_ids: list[int] = tokens[1:].tolist()
    actual_lps = _floats(scored.sampled_logprobs)
    ids, lps, ranks = [], [], []
    for top, vals, tok, lp in zip(row_ids, row_lps, actual_ids, actual_lps, strict=True):
        rank = top.index(tok) + 1 if tok in top else engine_k + 1
        e_ids, e_lps, e_ranks = [tok], [lp], [rank]
        for r, (t, v) in enumerate(zip(top[:k], vals[:k], strict=True), 1):
            if t != tok:
                e_ids.append(t)
                e_lps.append(v)
                e_ranks.append(r)
        ids.append(e_ids)
        lps.append(e_lps)
        ranks.append(e_ranks)
    return PromptEntries(ids, lps, ranks)


def _prompt_logprobs_json(entries: PromptEntries, texts: TokenTexts | None) -> str:
    """``[null, {...}, ...]`` (vLLM's ``prompt_logprobs`` of one prompt)."""
    out = ["null"]
    for ids, lps, ranks in zip(entries.ids, entries.lps, entries.ranks, strict=True):
        if texts is None:
            parts = [
                f'"{t}":{{"logprob":{v!r},"rank":{r}}}'
                for t, v, r in zip(ids, lps, ranks, strict=True)
            ]
        else:
            parts = [
                f'"{t}":{{"logprob":{v!r},"rank":{r},"decoded_token":{texts.json(t)}}}'
                for t, v, r in zip(ids, lps, ranks, strict=True)
            ]
        out.append("{" + ",".join(parts) + "}")
    return "[" + ",".join(out) + "]"


def _echo_logprobs(
    tokens: npt.NDArray[np.int32], entries: PromptEntries, n: int, texts: TokenTexts
) -> dict[str, Any]:
    """vLLM's completion ``logprobs`` of an echoed prompt with ``logprobs=n``."""
    token_texts = [texts.text(t) for t in tokens.tolist()]
    token_logprobs: list[float | None] = [None, *(lps[0] for lps in entries.lps)]
    top: list[dict[str, float] | None] = [None]
    for ids, lps in zip(entries.ids, entries.lps, strict=True):
        top.append({texts.text(t): v for t, v in zip(ids[: n + 1], lps[: n + 1], strict=True)})
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
        prompt_lp = "null"
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
        choices.append(
            f'{{"index":{index},"text":{json.dumps(out_text, ensure_ascii=False)},'
            f'"logprobs":{json.dumps(logprobs, ensure_ascii=False)},"finish_reason":"length",'
            f'"stop_reason":null,"prompt_logprobs":{prompt_lp}}}'
        )
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
    return f'{head},"choices":[{",".join(choices)}],"usage":{usage}}}'.encode()


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
    return f'{head},"prompt_logprobs":{prompt_lp}}}'.encode()


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
        self._texts: TokenTexts | None = None

    def _token_texts(self) -> TokenTexts | None:
        tokenizer = self._pipeline.backend.tokenizer
        if tokenizer is None:
            return None
        if self._texts is None:
            self._texts = TokenTexts(tokenizer)
        return self._texts

    def _model(self) -> str:
        info = self._info()
        return info.model_name if info else ""

    async def completions(self, body: bytes, client: Hashable = None) -> HTTPAnswer:
        """``POST /v1/completions``."""
        texts = self._token_texts()

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
