"""The answers' renderers of SGLang's ``/generate`` and vLLM's ``/v1/completions`` and
``/inference/v1/generate`` as they were before :mod:`teacher_server.http_api.json_arrays`:
a Python f-string per (log-prob, id) entry, each float as Python's ``repr`` of its
float64 value. Kept as the reference the vectorized renderers are tested against (the
same JSON once every float is read as float32) and timed against
(:mod:`benchmarks.bench_json_render`); nothing serves with them."""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.http_api.sglang.protocol import GenerateItem, GenerateRequest
from teacher_server.http_api.text import TokenTexts
from teacher_server.http_api.vllm.protocol import PromptLogprobsRequest
from topk_protocol import SequenceArrays
from topk_protocol.errors import TeacherError
from topk_protocol.trl_layout import JSON_NEG_INF

__all__ = [
    "PromptEntries",
    "as_float32",
    "float_shape",
    "prompt_entries",
    "render_completions",
    "render_generate",
    "render_token_generate",
]

# Outside a JSON string, a JSON number with a fraction or an exponent (every float
# either renderer writes; an integer has neither).
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?')


def as_float32(value: Any) -> Any:
    """Parsed JSON ``value`` with every float rounded to float32 (what two renderers of
    the same arrays must agree on)."""
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, list):
        return [as_float32(v) for v in value]
    if isinstance(value, dict):
        return {k: as_float32(v) for k, v in value.items()}
    return value


def float_shape(body: bytes) -> str:
    """``body``'s JSON text with every float written ``F``: the layout, byte for byte,
    apart from how the floats are written."""

    def mark(match: re.Match[str]) -> str:
        token = match.group(0)
        if token.startswith('"') or not any(c in token for c in ".eE"):
            return token
        return "F"

    return _TOKENS.sub(mark, body.decode())


# -- SGLang's /generate ----------------------------------------------------------------


def _floats(values: npt.NDArray[np.float32]) -> list[float]:
    """Python floats, ``-inf`` (and a NaN, which no asked row holds) as JSON_NEG_INF."""
    if not np.isfinite(values).all():
        values = np.where(np.isfinite(values), values, np.float32(JSON_NEG_INF))
    out: list[float] = values.tolist()
    return out


def _text(texts: TokenTexts | None, token: int) -> str:
    """An entry's text element: the token's text as JSON (``return_text_in_logprobs``)."""
    return "null" if texts is None else texts.json(token)


def _pairs(lps: list[float], ids: list[int], texts: TokenTexts | None) -> str:
    """``[[lp, id, text], ...]`` for one position."""
    pairs = (f"[{v!r},{t},{_text(texts, t)}]" for v, t in zip(lps, ids, strict=True))
    return "[" + ",".join(pairs) + "]"


def _rows(first: str, rows: list[str]) -> str:
    return "[" + ",".join([first, *rows]) + "]"


def _candidate_rows(
    item: GenerateItem, scored: SequenceArrays, n: int, texts: TokenTexts | None
) -> list[str]:
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
        out.append(_pairs(lps[:width], row[:width], texts))
    return out


def _meta_logprobs(item: GenerateItem, scored: SequenceArrays, texts: TokenTexts | None) -> str:
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
    entries = [f"[null,{tokens[0]},{_text(texts, tokens[0])}]"]
    entries += [f"[{v!r},{t},{_text(texts, t)}]" for v, t in zip(actual, tokens[1:], strict=True)]
    fields = [f'"input_token_logprobs":[{",".join(entries)}]', '"output_token_logprobs":[]']
    if item.top_logprobs_num:
        top = item.top_logprobs_num
        lps: list[list[float]] = _floats(scored.logprobs[:, :top])  # type: ignore[assignment]
        ids: list[list[int]] = scored.ids[:, :top].tolist()
        rows = [_pairs(r, i, texts) for r, i in zip(lps, ids, strict=True)]
        fields += [f'"input_top_logprobs":{_rows("null", rows)}', '"output_top_logprobs":[]']
    if item.candidate_ids is not None:
        rows = _candidate_rows(item, scored, n, texts)
        fields += [
            f'"input_token_ids_logprobs":{_rows("null", rows)}',
            '"output_token_ids_logprobs":[]',
        ]
    return "," + ",".join(fields)


def render_generate(
    request: GenerateRequest,
    scored: list[SequenceArrays],
    seconds: float,
    texts: TokenTexts | None = None,
) -> bytes:
    """SGLang's ``/generate`` answer to ``request`` from its scored sequences (one per
    item, rows :attr:`GenerateItem.rows`); ``seconds``: the teacher's time so far;
    ``texts``: each entry's text with ``return_text_in_logprobs``."""
    table = texts if request.text_in_logprobs else None
    answers = []
    for item, arrays in zip(request.items, scored, strict=True):
        meta = (
            f'{{"id":{json.dumps(item.rid)},"finish_reason":{{"type":"length","length":0}},'
            f'"prompt_tokens":{len(item.token_ids)},"completion_tokens":0,'
            f'"e2e_latency":{seconds!r}{_meta_logprobs(item, arrays, table)}}}'
        )
        answers.append(f'{{"text":"","output_ids":[],"meta_info":{meta}}}')
    body = f"[{','.join(answers)}]" if request.batched else answers[0]
    return body.encode()


# -- vLLM's /v1/completions and /inference/v1/generate ---------------------------------


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
