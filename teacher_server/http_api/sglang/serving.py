"""SGLang's ``/generate`` through the request pipeline, answered in SGLang's layout.

A body is read into a :class:`~teacher_server.http_api.sglang.protocol.GenerateRequest`,
scored as one ``ScoreRequest`` (:func:`teacher_server.http_api.scoring.score_body`: the
same lifecycle, validation, admission, backend and metrics as gRPC ``Score``), and its
answer rendered here, in a worker thread, as SGLang shapes it: per sequence
``{"text": "", "output_ids": [], "meta_info": {...}}`` (a JSON list of them for a batch),
``meta_info`` with ``id``, ``finish_reason`` (``{"type": "length", "length": 0}``),
``prompt_tokens``, ``completion_tokens`` 0, ``e2e_latency`` and, with
``return_logprob``, ``input_token_logprobs`` (``[logprob, token_id, null]`` per input
position from ``logprob_start_len``, the first ``[null, token_id, null]``),
``output_token_logprobs`` ``[]``, and with ``top_logprobs_num`` / ``token_ids_logprob``
``input_top_logprobs`` / ``input_token_ids_logprobs`` (``null`` first, then a list of
``[logprob, token_id, null]`` per position) and their empty ``output_*`` twins.

The answer is written as bytes from the arrays' lists (no dict per entry); a ``-inf``
log-prob is written as :data:`~topk_protocol.trl_layout.JSON_NEG_INF` (JSON has no
infinity). Refusals are SGLang's error shape, ``{"error": {"message": ...}}``, with the
HTTP status of :func:`teacher_server.http_api.answers.http_status`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.http_api.answers import HTTPAnswer, http_status
from teacher_server.http_api.bodies import json_object
from teacher_server.http_api.scoring import score_body
from teacher_server.http_api.sglang.protocol import GenerateItem, GenerateRequest, parse_generate
from teacher_server.pipeline import Refused, RequestPipeline
from teacher_server.validation import Limits
from topk_protocol import SequenceArrays, pb
from topk_protocol.errors import TeacherError
from topk_protocol.trl_layout import JSON_NEG_INF

__all__ = ["GENERATE_METHOD", "SGLangEndpoints", "render_generate", "sglang_error"]

#: The route's metric label (``method``).
GENERATE_METHOD = "HTTP /generate"


def sglang_error(status: int, message: str) -> HTTPAnswer:
    """SGLang's error answer: ``{"error": {"message": ...}}`` with ``status``."""
    return HTTPAnswer(status, json.dumps({"error": {"message": message}}).encode())


def _floats(values: npt.NDArray[np.float32]) -> list[float]:
    """Python floats, ``-inf`` (and a NaN, which no asked row holds) as JSON_NEG_INF."""
    if not np.isfinite(values).all():
        values = np.where(np.isfinite(values), values, np.float32(JSON_NEG_INF))
    out: list[float] = values.tolist()
    return out


def _pairs(lps: list[float], ids: list[int]) -> str:
    """``[[lp, id, null], ...]`` for one position."""
    return "[" + ",".join(f"[{v!r},{t},null]" for v, t in zip(lps, ids, strict=True)) + "]"


def _rows(first: str, rows: list[str]) -> str:
    return "[" + ",".join([first, *rows]) + "]"


def _candidate_rows(item: GenerateItem, scored: SequenceArrays, n: int) -> list[str]:
    """``input_token_ids_logprobs`` entries 1 .. n - 1: each position's ids (the shared
    ``token_ids_logprob``, or that position's own list, its -1 padding dropped)."""
    ids = item.candidate_rows()
    if ids is None:
        return ["[]"] * (n - 1)
    if scored.candidate_logprobs is None:
        raise TeacherError("teacher: the backend gave no candidate log-probs")
    clps: list[list[float]] = _floats(scored.candidate_logprobs)  # type: ignore[assignment]
    id_rows: list[list[int]] = ids.tolist()
    out = []
    for lps, row in zip(clps, id_rows, strict=True):
        width = row.index(-1) if -1 in row else len(row)
        out.append(_pairs(lps[:width], row[:width]))
    return out


def _meta_logprobs(item: GenerateItem, scored: SequenceArrays) -> str:
    """The log-prob fields of one item's ``meta_info`` (leading comma included)."""
    if not item.return_logprob:
        return ""
    n = item.num_entries
    if n == 0:
        fields = ['"input_token_logprobs":[]', '"output_token_logprobs":[]']
        if item.top_logprobs_num:
            fields += ['"input_top_logprobs":[]', '"output_top_logprobs":[]']
        if item.candidate_ids is not None:
            fields += ['"input_token_ids_logprobs":[]', '"output_token_ids_logprobs":[]']
        return "," + ",".join(fields)
    start = item.logprob_start
    tokens: list[int] = item.token_ids[start:].tolist()
    if scored.sampled_logprobs is None:
        raise TeacherError("teacher: the backend gave no actual-token log-probs")
    actual = _floats(scored.sampled_logprobs)
    entries = [f"[null,{tokens[0]},null]"]
    entries += [f"[{v!r},{t},null]" for v, t in zip(actual, tokens[1:], strict=True)]
    fields = [f'"input_token_logprobs":[{",".join(entries)}]', '"output_token_logprobs":[]']
    if item.top_logprobs_num:
        top = item.top_logprobs_num
        lps: list[list[float]] = _floats(scored.logprobs[:, :top])  # type: ignore[assignment]
        ids: list[list[int]] = scored.ids[:, :top].tolist()
        rows = [_pairs(r, i) for r, i in zip(lps, ids, strict=True)]
        fields += [f'"input_top_logprobs":{_rows("null", rows)}', '"output_top_logprobs":[]']
    if item.candidate_ids is not None:
        rows = _candidate_rows(item, scored, n)
        fields += [
            f'"input_token_ids_logprobs":{_rows("null", rows)}',
            '"output_token_ids_logprobs":[]',
        ]
    return "," + ",".join(fields)


def render_generate(
    request: GenerateRequest, scored: list[SequenceArrays], seconds: float
) -> bytes:
    """SGLang's ``/generate`` answer to ``request`` from its scored sequences (one per
    item, rows :attr:`GenerateItem.rows`); ``seconds``: the teacher's time so far."""
    answers = []
    for item, arrays in zip(request.items, scored, strict=True):
        meta = (
            f'{{"id":{json.dumps(item.rid)},"finish_reason":{{"type":"length","length":0}},'
            f'"prompt_tokens":{len(item.token_ids)},"completion_tokens":0,'
            f'"e2e_latency":{seconds!r}{_meta_logprobs(item, arrays)}}}'
        )
        answers.append(f'{{"text":"","output_ids":[],"meta_info":{meta}}}')
    body = f"[{','.join(answers)}]" if request.batched else answers[0]
    return body.encode()


class SGLangEndpoints:
    """``POST /generate``: body bytes in, :class:`HTTPAnswer` out.

    Args:
        pipeline: the request pipeline ``Score`` runs through; its backend's tokenizer
            encodes ``text``.
        info: the teacher's ``TeacherInfo`` once loaded.
    """

    def __init__(
        self, pipeline: RequestPipeline, info: Callable[[], pb.TeacherInfo | None]
    ) -> None:
        self._pipeline = pipeline
        self._info = info

    def _parse(self, body: bytes, _info: pb.TeacherInfo, limits: Limits) -> GenerateRequest:
        data: dict[str, Any] = json_object(body)
        return parse_generate(data, self._pipeline.backend.tokenizer, limits)

    async def generate(self, body: bytes, client: Hashable = None) -> HTTPAnswer:
        """SGLang's ``POST /generate``."""

        def refuse(refused: Refused) -> HTTPAnswer:
            return sglang_error(http_status(refused.code), refused.message)

        return await score_body(
            self._pipeline,
            self._info,
            GENERATE_METHOD,
            body,
            self._parse,
            render_generate,
            refuse,
            client,
        )
