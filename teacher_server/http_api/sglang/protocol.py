"""SGLang's ``POST /generate`` request, the subset a teacher answers, read into
:class:`GenerateRequest`; and which of our payload rows SGLang's input log-probs are.

SGLang's layout (``GenerateReqInput``, its scheduler's input log-probs): with
``return_logprob`` and ``logprob_start_len = s`` (``0 <= s <= L``; ``-1``, the default,
means no input log-probs), ``meta_info.input_token_logprobs`` holds one entry per input
position ``q`` in ``[s, L)``: ``[logprob of x[q] given x[:q], x[q], text]``. Its first
entry (position ``s``, whatever ``s``) has no log-prob: SGLang pads it with ``None``
(``input_top_logprobs`` and ``input_token_ids_logprobs`` too: ``None`` there). Our row
``t`` is the distribution of ``x[t + 1]`` (docs/protocol.md), so the entries at
``q = s + 1 .. L - 1`` are our rows ``s .. L - 2`` (:func:`input_rows`), and SGLang's
``input_top_logprobs`` and ``input_token_ids_logprobs`` (``token_ids_logprob``: the same
ids at every position: our candidates) come from the same rows.

Pure: the body is a ``dict`` already (parsed JSON), the tokenizer passed in; every
refusal an :class:`~topk_protocol.errors.InvalidRequestError` naming the field and the
limit (:mod:`teacher_server.http_api.bodies`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.http_api.bodies import (
    FieldRules,
    IgnoredField,
    invalid,
    shown,
    token_ids,
)
from teacher_server.http_api.text import encode_text
from teacher_server.validation import Limits
from topk_protocol import Span, encode_token_ids, pb
from topk_protocol.checks import check_top_k, check_total_tokens

__all__ = [
    "GENERATE_RULES",
    "SAMPLING_RULES",
    "GenerateItem",
    "GenerateRequest",
    "input_rows",
    "parse_generate",
]

#: ``POST /generate`` against SGLang's ``GenerateReqInput`` (the rule of
#: :class:`~teacher_server.http_api.bodies.FieldRules`): what the answer's input
#: log-probs depend on is read; routing, caching, tracing and output-only options are
#: ignored; inputs other than token ids and texts, and extra outputs, are refused.
GENERATE_RULES = FieldRules(
    stock="SGLang's GenerateReqInput",
    read=frozenset({"rid", "text", "input_ids", "sampling_params", "return_logprob"})
    | {"logprob_start_len", "top_logprobs_num", "token_ids_logprob"}
    | {"token_ids_logprob_positions", "return_text_in_logprobs", "stream", "image_data"},
    ignored=frozenset({"session_id", "log_metrics", "routed_experts_start_len", "modalities"})
    | {"mm_hashes", "mm_content_hashes", "use_audio_in_video", "video_config"}
    | {"bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key"}
    | {"decode_tp_size", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"}
    | {"kv_router_hint", "routing_key", "conversation_id", "http_worker_ipc", "background"}
    | {"require_reasoning", "max_thinking_tokens", "priority", "extra_key", "no_logs"}
    | {"custom_labels", "external_trace_header", "received_time", "need_wait_for_mm_inputs"}
    | {"num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch"}
    | {"image_max_dynamic_patch", "video_max_dynamic_patch", "images_config", "cache_salt"}
    | {"custom_logit_processor", "return_sampling_mask", "return_bytes"},
    refused={
        "input_embeds": "this teacher scores token ids and texts only",
        "video_data": "this teacher scores text tokens only",
        "audio_data": "this teacher scores text tokens only",
        "positional_embed_overrides": "this teacher scores token ids and texts only",
        "session_params": "send the whole sequence to score (sessions are not kept)",
        "multi_item_delimiter_indices": "multi-item scoring is not served",
        "lora_path": "one teacher is served, without adapters",
        "lora_id": "one teacher is served, without adapters",
        "return_flat_raw_top_logprobs": "input_top_logprobs come as SGLang's nested lists",
        "return_flat_raw_top_logprobs_b64": "input_top_logprobs come as nested lists",
        "return_hidden_states": "hidden states are not served",
        "return_routed_experts": "routed experts are not served",
        "return_indexer_topk": "indexer top-k is not served",
        "return_entropy": "entropy is not served",
        "return_prompt_token_ids": "the answer does not repeat the prompt's token ids",
    },
)
#: ``sampling_params`` against SGLang's ``SamplingParams``, which refuses a key it does
#: not declare: every option changes only generated tokens (none is generated here).
#: ``temperature`` is among them: SGLang's input log-probs are the model's own whatever
#: the request's temperature (unless its server is started with
#: ``SGLANG_TEMP_SCALED_LOGPROBS``); here they are at the served teacher temperature.
SAMPLING_RULES = FieldRules(
    stock="SGLang's SamplingParams",
    read=frozenset({"max_new_tokens", "n"}),
    ignored=frozenset({"temperature", "top_p", "top_k", "min_p", "frequency_penalty"})
    | {"presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "stop_regex"}
    | {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
    | {"min_new_tokens", "sampling_seed", "logit_bias", "custom_params", "json_schema"}
    | {"regex", "ebnf", "structural_tag", "stream_interval"},
    refuse_undeclared=True,
)


def input_rows(length: int, start: int) -> Span:
    """Our payload rows ``[a, b)`` behind SGLang's input log-probs of a sequence of
    ``length`` tokens from ``logprob_start_len = start`` (``0 <= start <= length``): the
    entries at positions ``start + 1 .. length - 1``, i.e. rows ``start .. length - 2``
    (empty when ``start >= length - 1``)."""
    end = length - 1
    return min(start, end), end


@dataclass(frozen=True)
class GenerateItem:
    """One sequence of a ``/generate`` request, checked.

    ``token_ids`` ``[L]``; ``logprob_start`` SGLang's ``logprob_start_len`` resolved into
    ``[0, L]`` (``L``: no input log-probs, SGLang's ``-1``); ``top_logprobs_num`` N (0:
    none); ``candidate_ids`` ``[C]`` (``token_ids_logprob``: the same ids at every
    position) or ``[E, C]`` (``token_ids_logprob_positions``: one list per entry, ``E =
    L - start``, padded with -1), or None; ``rid`` the answer's ``meta_info.id``."""

    token_ids: npt.NDArray[np.int32]
    return_logprob: bool
    logprob_start: int
    top_logprobs_num: int
    candidate_ids: npt.NDArray[np.int32] | None
    rid: str

    @property
    def rows(self) -> Span:
        """Our payload rows this item needs (none without ``return_logprob``)."""
        if not self.return_logprob:
            return 0, 0
        return input_rows(len(self.token_ids), self.logprob_start)

    def candidate_rows(self) -> npt.NDArray[np.int32] | None:
        """The candidate ids of our rows ``[S, C]`` (entries 1 .. E - 1; None: none, or
        no rows, or every list empty)."""
        start, end = self.rows
        if self.candidate_ids is None or end == start:
            return None
        if self.candidate_ids.ndim == 1:
            return np.broadcast_to(self.candidate_ids, (end - start, self.candidate_ids.size))
        rows = self.candidate_ids[1:]
        return rows if rows.shape[1] else None

    @property
    def num_entries(self) -> int:
        """Entries of ``input_token_logprobs``: ``L - start`` (0 without log-probs)."""
        return len(self.token_ids) - self.logprob_start if self.return_logprob else 0


@dataclass(frozen=True)
class GenerateRequest:
    """A ``/generate`` body, checked: its items and whether it was a batch (the answer
    is then a JSON list, else one object)."""

    items: list[GenerateItem]
    batched: bool
    text_in_logprobs: bool = False
    ignored_fields: tuple[IgnoredField, ...] = ()

    @property
    def top_k(self) -> int:
        """K asked of the engine: the largest ``top_logprobs_num`` (at least 1: the
        actual tokens' log-probs ride along with any K)."""
        return max([1, *(i.top_logprobs_num for i in self.items)])

    def score_request(self) -> pb.ScoreRequest:
        """One ``ScoreRequest`` (float32, the actual tokens' log-probs included) with
        each item's rows and, with ``token_ids_logprob``, the same ids at each row."""
        req = pb.ScoreRequest(
            request_id=uuid.uuid4().hex[:12], top_k=self.top_k, dtype=pb.LOGPROB_DTYPE_FLOAT32
        )
        for item in self.items:
            start, end = item.rows
            seq = req.sequences.add(
                token_ids=encode_token_ids(item.token_ids), position_start=start, position_end=end
            )
            rows = item.candidate_rows()
            if rows is not None:
                seq.candidate_ids = np.ascontiguousarray(rows, dtype="<i4").tobytes()
                seq.num_candidates = rows.shape[1]
        return req


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def _per_item(data: dict[str, Any], name: str, n: int, batched: bool, default: Any) -> list[Any]:
    """A field SGLang takes as one value for every item or, in a batch, one per item."""
    value = data.get(name)
    if value is None:
        return [default] * n
    if batched and isinstance(value, list) and not (name == "token_ids_logprob" and _is_ids(value)):
        if len(value) != n:
            raise invalid(f"{name}: {len(value)} values for {n} sequences")
        return [default if v is None else v for v in value]
    return [value] * n


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(f"{field}: expected true or false, got {shown(value)}")
    return value


def _int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{field}: expected an int, got {shown(value)}")
    return value


def _check_sampling(params: Any, field: str) -> list[IgnoredField]:
    """One ``sampling_params`` object checked; the keys it ignores."""
    if not isinstance(params, dict):
        raise invalid(f"{field}: expected an object, got {shown(params)}")
    ignored = SAMPLING_RULES.apply(params, prefix=f"{field}.")
    max_new = params.get("max_new_tokens")
    max_new = 0 if max_new is None else _int(max_new, f"{field}.max_new_tokens")
    if max_new not in (0, 1):
        raise invalid(f"{field}.max_new_tokens: {max_new}; this teacher generates nothing (0 or 1)")
    n = _int(params.get("n", 1), f"{field}.n")
    if n != 1:
        raise invalid(f"{field}.n: {n}; only n = 1 is served")
    return ignored


def _sequences(data: dict[str, Any], tokenizer: Any, limits: Limits) -> tuple[list[Any], bool]:
    """The token id sequences of ``input_ids`` or ``text`` and whether they were a batch."""
    ids, text = data.get("input_ids"), data.get("text")
    if (ids is None) == (text is None):
        raise invalid("input_ids, text: give exactly one of them")
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise invalid(f"input_ids: expected a non-empty list of token ids, got {shown(ids)}")
        if _is_ids(ids):
            check_total_tokens(len(ids), limits, "input_ids")
            return [token_ids(ids, "input_ids", limits)], False
        check_total_tokens(
            sum(len(v) if isinstance(v, list) else 0 for v in ids), limits, "input_ids"
        )
        return [token_ids(v, f"input_ids[{i}]", limits) for i, v in enumerate(ids)], True
    if isinstance(text, list):
        if not text:
            raise invalid("text: expected a string or a non-empty list of strings")
        seqs = [encode_text(t, tokenizer, f"text[{i}]", limits) for i, t in enumerate(text)]
        check_total_tokens(sum(len(s) for s in seqs), limits, "text")
        return seqs, True
    seq = encode_text(text, tokenizer, "text", limits)
    check_total_tokens(len(seq), limits, "text")
    return [seq], False


def _rids(value: Any, n: int, batched: bool) -> list[str]:
    if value is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if batched and isinstance(value, list):
        if len(value) != n or not all(isinstance(r, str) for r in value):
            raise invalid(f"rid: expected {n} strings (one per sequence), got {shown(value)}")
        return list(value)
    if not isinstance(value, str):
        raise invalid(f"rid: expected a string, got {shown(value)}")
    return [f"{value}_{i}" for i in range(n)] if batched else [value]


def _candidates(value: Any, field: str, limits: Limits) -> npt.NDArray[np.int32] | None:
    if value is None:
        return None
    if not _is_ids(value) or not value:
        raise invalid(f"{field}: expected a non-empty list of token ids, got {shown(value)}")
    if len(value) > limits.max_candidates:
        why = " (this teacher scores no candidates)" if limits.max_candidates == 0 else ""
        raise invalid(
            f"{field}: {len(value)} ids exceeds max_candidates {limits.max_candidates}{why}"
        )
    return token_ids(value, field, limits)


def _position_candidates(
    value: Any, field: str, entries: int, limits: Limits
) -> npt.NDArray[np.int32] | None:
    """``token_ids_logprob_positions``: one id list per entry of ``input_token_logprobs``
    (``entries`` of them, aligned with ``logprob_start_len``) -> ``[E, C]`` padded -1."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, list) for v in value):
        raise invalid(f"{field}: expected one list of token ids per input position")
    if len(value) != entries:
        raise invalid(
            f"{field}: {len(value)} lists for the {entries} input positions from "
            "logprob_start_len (one per entry of input_token_logprobs)"
        )
    width = max((len(v) for v in value), default=0)
    if width > limits.max_candidates:
        why = " (this teacher scores no candidates)" if limits.max_candidates == 0 else ""
        raise invalid(
            f"{field}: {width} ids at one position exceeds max_candidates "
            f"{limits.max_candidates}{why}"
        )
    out = np.full((entries, width), -1, np.int32)
    for q, ids in enumerate(value):
        if ids:
            if not _is_ids(ids):
                raise invalid(f"{field}[{q}]: expected a list of token ids, got {shown(ids)}")
            out[q, : len(ids)] = token_ids(ids, f"{field}[{q}]", limits)
    return out


def parse_generate(data: dict[str, Any], tokenizer: Any, limits: Limits) -> GenerateRequest:
    """A ``/generate`` body (parsed JSON) -> :class:`GenerateRequest` (``tokenizer``:
    the teacher's, for ``text``; None: token ids only)."""
    ignored = GENERATE_RULES.apply(data)
    if data.get("stream"):
        raise invalid("stream: not supported (the input log-probs come in one answer)")
    if data.get("image_data"):
        raise invalid("image_data: not supported (this teacher scores text tokens only)")
    text_flag = data.get("return_text_in_logprobs")
    text_in_logprobs = _bool(False if text_flag is None else text_flag, "return_text_in_logprobs")
    seqs, batched = _sequences(data, tokenizer, limits)
    n = len(seqs)
    sampling = _per_item(data, "sampling_params", n, batched, {})
    returns = _per_item(data, "return_logprob", n, batched, False)
    starts = _per_item(data, "logprob_start_len", n, batched, -1)
    tops = _per_item(data, "top_logprobs_num", n, batched, 0)
    cands = _per_item(data, "token_ids_logprob", n, batched, None)
    positions = _per_item(data, "token_ids_logprob_positions", n, batched, None)
    if data.get("token_ids_logprob") is not None and data.get("token_ids_logprob_positions"):
        raise invalid("token_ids_logprob_positions: give it or token_ids_logprob, not both")
    rids = _rids(data.get("rid"), n, batched)
    items = []
    for i, seq in enumerate(seqs):
        at = f"[{i}]" if batched else ""
        listed = isinstance(data.get("sampling_params"), list)
        if i == 0 or listed:
            ignored += _check_sampling(sampling[i], f"sampling_params{at if listed else ''}")
        length = len(seq)
        start = _int(starts[i], f"logprob_start_len{at}")
        if start < -1 or start > length:
            raise invalid(
                f"logprob_start_len{at}: {start} is outside [-1, {length}] (the input's "
                f"{length} tokens; -1: no input log-probs)"
            )
        resolved = length if start == -1 else start
        candidates = _candidates(cands[i], f"token_ids_logprob{at}", limits)
        if positions[i] is not None:
            field = f"token_ids_logprob_positions{at}"
            candidates = _position_candidates(positions[i], field, length - resolved, limits)
        top = _int(tops[i], f"top_logprobs_num{at}")
        if top:
            check_top_k(top, limits, f"top_logprobs_num{at}")
        items.append(
            GenerateItem(
                token_ids=seq,
                return_logprob=_bool(returns[i], f"return_logprob{at}"),
                logprob_start=resolved,
                top_logprobs_num=top,
                candidate_ids=candidates,
                rid=rids[i],
            )
        )
    return GenerateRequest(items, batched, text_in_logprobs, tuple(ignored))
