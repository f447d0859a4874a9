"""SGLang's ``/generate`` through the request pipeline, answered in SGLang's layout.

A body is read into a :class:`~teacher_server.http_api.sglang.protocol.GenerateRequest`,
scored as one ``ScoreRequest`` (:func:`teacher_server.http_api.scoring.score_body`: the
same lifecycle, validation, admission, backend and metrics as gRPC ``Score``), and its
answer rendered here, in a worker thread, as SGLang shapes it: per sequence
``{"text": "", "output_ids": [], "meta_info": {...}}`` (a JSON list of them for a batch),
``meta_info`` with ``id``, ``finish_reason`` (``{"type": "length", "length": 0}``),
``prompt_tokens``, ``completion_tokens`` 0, ``e2e_latency`` and, with
``return_logprob``, ``input_token_logprobs`` (``[logprob, token_id, text]`` per input
position from ``logprob_start_len``, the first ``[null, token_id, text]``),
``output_token_logprobs`` ``[]``, and with ``top_logprobs_num`` / ``token_ids_logprob``
``input_top_logprobs`` / ``input_token_ids_logprobs`` (``null`` first, then a list of
``[logprob, token_id, text]`` per position) and their empty ``output_*`` twins; ``text``
is null, or with ``return_text_in_logprobs`` the token's text
(:class:`~teacher_server.http_api.text.TokenTexts`).

The log-prob fields are written from the arrays by
:mod:`teacher_server.http_api.json_arrays` (no Python object per entry; each log-prob
the shortest decimal that reads back as the same float32); a ``-inf`` log-prob (or a
NaN, which no asked row holds) is written as :data:`~topk_protocol.trl_layout.JSON_NEG_INF`
(JSON has no infinity). Refusals are SGLang's error shape, ``{"error": {"message": ...}}``, with the
HTTP status of :func:`teacher_server.http_api.answers.http_status`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
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
from teacher_server.http_api.sglang.protocol import GenerateItem, GenerateRequest, parse_generate
from teacher_server.http_api.text import LazyTokenTexts, TokenTexts
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


def _entries(
    lps: npt.NDArray[np.float32], ids: npt.NDArray[np.int32], texts: TokenTexts | None
) -> Cells:
    """``[lp, id, text]`` per entry of ``lps`` / ``ids`` (same shape, read row-major):
    ``text`` the token's text with ``texts`` (``return_text_in_logprobs``), else null."""
    text: Cells | bytes = b"null" if texts is None else texts.json_cells(ids)
    return concat(
        b"[",
        json_floats(lps.reshape(-1), nonfinite=JSON_NEG_INF),
        b",",
        json_ints(ids.reshape(-1)),
        b",",
        text,
        b"]",
    )


def _after_null(rows: bytes) -> bytes:
    """``[null, rows...]``: an input field's entries, position 0 ``null``."""
    return b"[null," + rows + b"]" if rows else b"[null]"


def _position_lists(
    lps: npt.NDArray[np.float32],
    ids: npt.NDArray[np.int32],
    keep: npt.NDArray[np.bool_],
    texts: TokenTexts | None,
) -> bytes:
    """``[null, [[lp, id, text], ...] per row]`` of ``[S, W]`` log-probs and ids (the
    entries where ``keep``)."""
    if lps.shape[0] == 0:
        return b"[null]"
    return _after_null(joined(json_lists(_entries(lps, ids, texts), keep)))


def _candidate_lists(
    item: GenerateItem, scored: SequenceArrays, n: int, texts: TokenTexts | None
) -> bytes:
    """``input_token_ids_logprobs``: ``null``, then each position's ids (the shared
    ``token_ids_logprob``, or that position's own list, its -1 padding dropped)."""
    ids = item.candidate_rows()
    if ids is None:
        return _after_null((b"[]," * (n - 1))[:-1])
    if scored.candidate_logprobs is None:
        raise TeacherError("teacher: the backend gave no candidate log-probs")
    # A position's list ends at its first -1 (the padding).
    keep = np.logical_and.accumulate(ids != -1, axis=1)
    return _position_lists(scored.candidate_logprobs, np.maximum(ids, 0), keep, texts)


def _meta_logprobs(item: GenerateItem, scored: SequenceArrays, texts: TokenTexts | None) -> bytes:
    """The log-prob fields of one item's ``meta_info`` (leading comma included);
    ``texts``: each entry's text (``return_text_in_logprobs``), else null."""
    if not item.return_logprob:
        return b""
    n = item.num_entries
    if n == 0:
        fields = [b'"input_token_logprobs":[]', b'"output_token_logprobs":[]']
        if item.top_logprobs_num:
            fields += [b'"input_top_logprobs":[]', b'"output_top_logprobs":[]']
        if item.candidate_ids is not None:
            fields += [b'"input_token_ids_logprobs":[]', b'"output_token_ids_logprobs":[]']
        return b"," + b",".join(fields)
    tokens = item.token_ids[item.logprob_start :]
    if scored.sampled_logprobs is None:
        raise TeacherError("teacher: the backend gave no actual-token log-probs")
    first_text = b"null" if texts is None else texts.json(int(tokens[0])).encode()
    first = b"[null,%d,%s]" % (int(tokens[0]), first_text)
    actual = joined(_entries(scored.sampled_logprobs, tokens[1:], texts))
    entries = first + b"," + actual if actual else first
    fields = [b'"input_token_logprobs":[' + entries + b"]", b'"output_token_logprobs":[]']
    if item.top_logprobs_num:
        top = item.top_logprobs_num
        lps, ids = scored.logprobs[:, :top], scored.ids[:, :top]
        rows = _position_lists(lps, ids, np.ones(lps.shape, dtype=np.bool_), texts)
        fields += [b'"input_top_logprobs":' + rows, b'"output_top_logprobs":[]']
    if item.candidate_ids is not None:
        fields += [
            b'"input_token_ids_logprobs":' + _candidate_lists(item, scored, n, texts),
            b'"output_token_ids_logprobs":[]',
        ]
    return b"," + b",".join(fields)


def render_generate(
    request: GenerateRequest,
    scored: list[SequenceArrays],
    seconds: float,
    texts: TokenTexts | None = None,
) -> bytes:
    """SGLang's ``/generate`` answer to ``request`` from its scored sequences (one per
    item, rows :attr:`GenerateItem.rows`); ``seconds``: the teacher's time so far;
    ``texts``: the token texts (needed with ``return_text_in_logprobs``)."""
    if request.text_in_logprobs and texts is None:
        raise TeacherError("teacher: return_text_in_logprobs needs the backend's tokenizer")
    table = texts if request.text_in_logprobs else None
    answers = []
    for item, arrays in zip(request.items, scored, strict=True):
        meta = (
            f'{{"id":{json.dumps(item.rid)},"finish_reason":{{"type":"length","length":0}},'
            f'"prompt_tokens":{len(item.token_ids)},"completion_tokens":0,'
            f'"e2e_latency":{seconds!r}'
        ).encode()
        answers.append(
            b'{"text":"","output_ids":[],"meta_info":'
            + meta
            + _meta_logprobs(item, arrays, table)
            + b"}}"
        )
    return b"[" + b",".join(answers) + b"]" if request.batched else answers[0]


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
        self._texts = LazyTokenTexts(pipeline.backend)

    def _parse(self, body: bytes, _info: pb.TeacherInfo, limits: Limits) -> GenerateRequest:
        data: dict[str, Any] = json_object(body)
        parsed = parse_generate(data, self._pipeline.backend.tokenizer, limits)
        if parsed.text_in_logprobs and self._texts.get() is None:
            raise invalid(
                "return_text_in_logprobs: this teacher's backend has no tokenizer to write "
                "the tokens' text; send false"
            )
        return parsed

    def _render(self, parsed: GenerateRequest, scored: list[SequenceArrays], s: float) -> bytes:
        return render_generate(parsed, scored, s, self._texts.get())

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
            self._render,
            refuse,
            client,
        )
