"""vLLM's ``POST /v1/completions`` and token-in ``POST /inference/v1/generate``, the
subset a teacher answers, read into typed requests.

vLLM's prompt log-prob layout (``prompt_logprobs=K``): entry ``p`` of a prompt
``x[0..L-1]`` is the distribution of ``x[p]`` given ``x[:p]`` (entry 0 ``None``): TRL's
layout (:mod:`topk_protocol.trl_layout`), so a prompt's entries come from our rows
``[0, L - 1)`` (:func:`~topk_protocol.trl_layout.trl_span` with prompt length 0).

Who sends what (docs/frameworks.md): TRL 1.11+ token-id prompts with ``prompt_logprobs``
and ``max_tokens=1``; rllm's ``compute_logprobs`` token ids with ``echo``, ``logprobs=1``,
``max_tokens=1``, ``temperature`` and ``top_p`` 1; ms-swift and vime text prompts with
``prompt_logprobs``; Prime-RL ``/inference/v1/generate`` with ``token_ids`` and
``sampling_params`` ``{max_tokens: 1, temperature, top_p, prompt_logprobs}``; axolotl
a batch of token prompts with ``echo``, ``logprobs: true``, no ``max_tokens`` and keys
vLLM does not declare. Nothing is generated: ``max_tokens`` absent or null is served as 1,
above 1 refused by name, as are ``n`` above 1 and ``stream``; every other field follows
the routes' one rule (:class:`~teacher_server.http_api.bodies.FieldRules`:
:data:`COMPLETIONS_RULES`, :data:`GENERATE_RULES`, :data:`GENERATE_SAMPLING_RULES`).
``temperature``, when given, must be the served teacher temperature (a top-k answer
cannot be re-tempered).
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
    check_temperature,
    int_field,
    invalid,
    shown,
    token_id_lists,
    token_ids,
)
from teacher_server.http_api.text import encode_text
from teacher_server.validation import Limits
from topk_protocol import encode_token_ids, pb
from topk_protocol.checks import check_top_k, check_total_tokens
from topk_protocol.trl_layout import trl_span

__all__ = [
    "COMPLETIONS_RULES",
    "GENERATE_RULES",
    "GENERATE_SAMPLING_RULES",
    "IGNORED_SAMPLING",
    "PromptLogprobsRequest",
    "parse_completions",
    "parse_token_generate",
]

#: Sampling options that change only generated tokens: accepted and ignored (nothing is
#: generated), on both routes (``/inference/v1/generate`` takes them in
#: ``sampling_params``).
IGNORED_SAMPLING = frozenset(
    {"top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty"}
    | {"frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "logit_bias"}
    | {"skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"}
    | {"allowed_token_ids", "bad_words", "logprob_token_ids", "length_penalty", "use_beam_search"}
    | {"structured_outputs", "response_format", "thinking_token_budget", "repetition_detection"}
    | {"watermarking"}
)
#: Fields of vLLM's ``CompletionRequest`` that would change the answer and that a
#: prompt-scoring teacher cannot honor.
_REFUSED = {
    "truncate_prompt_tokens": "the prompt is scored whole; send the tokens to score",
    "prompt_embeds": "this teacher scores token ids and texts only",
    "return_tokens_as_token_ids": "entries are keyed by token id and carry decoded_token",
    "suffix": "nothing is generated, so no suffix is written",
    "vllm_xargs": "no custom sampling arguments reach this teacher's engine",
}
#: ``POST /v1/completions`` against vLLM's ``CompletionRequest`` (the rule of
#: :class:`~teacher_server.http_api.bodies.FieldRules`; tests/.../test_field_rules.py
#: checks that every field vLLM declares is in one of the three lists).
COMPLETIONS_RULES = FieldRules(
    stock="vLLM's CompletionRequest",
    read=frozenset({"model", "prompt", "max_tokens", "temperature", "prompt_logprobs", "n"})
    | {"stream", "echo", "logprobs", "add_special_tokens"},
    ignored=IGNORED_SAMPLING
    | {"user", "request_id", "session_id", "priority", "stream_options", "stream_interval"}
    | {"cache_salt", "kv_transfer_params", "ec_transfer_params", "mm_payload"}
    | {"return_mm_kwargs", "routed_experts_prompt_start", "return_token_offsets"}
    | {"truncation_side"},
    refused={
        **_REFUSED,
        "return_token_ids": "the answer does not repeat the prompt's token ids",
    },
)
#: ``POST /inference/v1/generate`` (vLLM's token-in ``GenerateRequest``) and its
#: ``sampling_params`` (vLLM's ``SamplingParams``).
GENERATE_RULES = FieldRules(
    stock="vLLM's GenerateRequest",
    read=frozenset({"model", "token_ids", "sampling_params", "request_id", "stream"}),
    ignored=frozenset({"cache_salt", "priority", "kv_transfer_params", "features"}),
)
GENERATE_SAMPLING_RULES = FieldRules(
    stock="vLLM's SamplingParams",
    read=frozenset({"max_tokens", "temperature", "prompt_logprobs", "n", "logprobs"}),
    ignored=IGNORED_SAMPLING | {"detokenize", "output_kind", "extra_args"},
    refused={
        "truncate_prompt_tokens": _REFUSED["truncate_prompt_tokens"],
        "flat_logprobs": "the answer's entries are vLLM's dictionaries",
    },
)


@dataclass(frozen=True)
class PromptLogprobsRequest:
    """A completions or token-in generate request, checked.

    ``sequences``: each prompt's ids ``[L]``; ``texts``: each prompt's text (None where
    ids were sent); ``prompt_logprobs`` K of vLLM's ``prompt_logprobs`` (None: not
    asked); ``logprobs`` N of ``logprobs`` (None: not asked; with ``echo`` it covers the
    prompt, as vLLM's); ``decoded``: entries carry ``decoded_token`` (text prompts and
    ``echo``)."""

    sequences: list[npt.NDArray[np.int32]]
    texts: list[str | None]
    prompt_logprobs: int | None
    logprobs: int | None = None
    echo: bool = False
    decoded: bool = False
    request_id: str = ""
    ignored_fields: tuple[IgnoredField, ...] = ()

    @property
    def prompt_k(self) -> int | None:
        """K of each choice's ``prompt_logprobs`` (vLLM's: the request's, or with
        ``echo`` and ``logprobs`` the latter's); None: not sent."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @property
    def top_k(self) -> int:
        """K asked of the engine (at least 1: the prompt tokens' own log-probs ride
        along with any K)."""
        wanted = [self.prompt_k or 0, (self.logprobs or 0) if self.echo else 0]
        return max(1, *wanted)

    def score_request(self) -> pb.ScoreRequest:
        """One ``ScoreRequest``: float32, the actual tokens' log-probs, each prompt's rows
        ``[0, L - 1)`` (vLLM's entries 1 .. L - 1)."""
        req = pb.ScoreRequest(
            request_id=uuid.uuid4().hex[:12], top_k=self.top_k, dtype=pb.LOGPROB_DTYPE_FLOAT32
        )
        for ids in self.sequences:
            start, end = trl_span(len(ids), 0)
            req.sequences.add(
                token_ids=encode_token_ids(ids), position_start=start, position_end=end
            )
        return req


def _check_model(data: dict[str, Any], served: str) -> None:
    model = data.get("model")
    if model is not None and model != served:
        raise invalid(f"model: {model!r} is not served here; this teacher serves {served!r}")


def _optional_k(data: dict[str, Any], name: str, limits: Limits) -> int | None:
    """``prompt_logprobs`` / ``logprobs``: None, or K in ``[0, max_top_k]`` (0: the
    tokens' own log-probs only)."""
    if data.get(name) is None:
        return None
    k = int_field(data, name)
    if k != 0:
        check_top_k(k, limits, name)
    return k


def _vllm_logprobs(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with a boolean ``logprobs`` read as vLLM's model reads it: an int field
    that takes ``true`` as 1 and ``false`` as 0 (axolotl sends ``logprobs: true``)."""
    value = data.get("logprobs")
    if isinstance(value, bool):
        return {"logprobs": int(value)}
    return data


def _check_generation(data: dict[str, Any], prefix: str = "") -> None:
    # Absent or null (vLLM: 16 tokens, or as many as fit) is served as 1: the teacher
    # scores the prompt and generates nothing (docs/frameworks.md).
    max_tokens = 1 if data.get("max_tokens") is None else int_field(data, "max_tokens")
    if max_tokens not in (0, 1):
        raise invalid(f"{prefix}max_tokens: {max_tokens}; this teacher generates nothing (0 or 1)")
    n = int_field(data, "n", 1)
    if n != 1:
        raise invalid(f"{prefix}n: {n}; only n = 1 is served")


def _prompts(
    value: Any, tokenizer: Any, limits: Limits, add_special_tokens: bool
) -> tuple[list[npt.NDArray[np.int32]], list[str | None]]:
    """vLLM's ``prompt``: a text, a list of texts, a list of ids, or a list of id lists."""
    if value is None:
        raise invalid("prompt: missing; expected token ids or a text (or a list of them)")
    texts = [value] if isinstance(value, str) else value
    if isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts):
        encode = tokenizer
        if tokenizer is not None and not add_special_tokens:
            encode = _NoSpecialTokens(tokenizer)
        field = (lambda i: "prompt") if isinstance(value, str) else (lambda i: f"prompt[{i}]")
        seqs = [encode_text(t, encode, field(i), limits) for i, t in enumerate(texts)]
        check_total_tokens(sum(len(s) for s in seqs), limits, "prompt")
        return seqs, list(texts)
    seqs = token_id_lists(value, "prompt", limits)
    return seqs, [None] * len(seqs)


class _NoSpecialTokens:
    """A tokenizer whose ``encode`` adds no special tokens (``add_special_tokens``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False)
        return ids


def parse_completions(
    data: dict[str, Any], info: pb.TeacherInfo, limits: Limits, tokenizer: Any
) -> PromptLogprobsRequest:
    """A ``/v1/completions`` body (parsed JSON) -> :class:`PromptLogprobsRequest`
    (``tokenizer``: the teacher's, for text prompts; None: ids only)."""
    ignored = COMPLETIONS_RULES.apply(data)
    _check_model(data, info.model_name)
    if data.get("stream"):
        raise invalid("stream: not supported (prompt log-probs come in one answer)")
    _check_generation(data)
    echo = data.get("echo", False)
    if not isinstance(echo, bool):
        raise invalid(f"echo: expected true or false, got {shown(echo)}")
    prompt_k = _optional_k(data, "prompt_logprobs", limits)
    logprobs = _optional_k(_vllm_logprobs(data), "logprobs", limits)
    if prompt_k is None and not (echo and logprobs is not None):
        raise invalid(
            "prompt_logprobs: missing; this teacher answers prompt log-probs only "
            "(prompt_logprobs=K, or echo with logprobs=N)"
        )
    check_temperature(data, info.teacher_temperature)
    special = data.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise invalid(f"add_special_tokens: expected true or false, got {shown(special)}")
    seqs, texts = _prompts(data.get("prompt"), tokenizer, limits, special)
    decoded = echo or any(t is not None for t in texts)
    return PromptLogprobsRequest(
        seqs, texts, prompt_k, logprobs, echo, decoded, ignored_fields=tuple(ignored)
    )


def parse_token_generate(
    data: dict[str, Any], info: pb.TeacherInfo, limits: Limits
) -> PromptLogprobsRequest:
    """A ``/inference/v1/generate`` body (vLLM's token-in generate, as Prime-RL sends it)
    -> :class:`PromptLogprobsRequest` (one prompt)."""
    ignored = GENERATE_RULES.apply(data)
    _check_model(data, info.model_name)
    if data.get("stream"):
        raise invalid("stream: not supported (prompt log-probs come in one answer)")
    params = data.get("sampling_params")
    if not isinstance(params, dict):
        raise invalid(f"sampling_params: expected an object, got {shown(params)}")
    ignored += GENERATE_SAMPLING_RULES.apply(params, prefix="sampling_params.")
    _check_generation(params, "sampling_params.")
    if params.get("logprobs") is not None:
        raise invalid(
            "sampling_params.logprobs: generated tokens' log-probs are not served (nothing "
            "is generated); use prompt_logprobs"
        )
    try:
        prompt_k = _optional_k(params, "prompt_logprobs", limits)
    except ValueError as e:
        raise invalid(f"sampling_params.{e}") from None
    if prompt_k is None:
        raise invalid(
            "sampling_params.prompt_logprobs: missing; this teacher answers prompt log-probs only"
        )
    try:
        check_temperature(params, info.teacher_temperature)
    except ValueError as e:
        raise invalid(f"sampling_params.{e}") from None
    ids = data.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise invalid(f"token_ids: expected a non-empty list of token ids, got {shown(ids)}")
    check_total_tokens(len(ids), limits, "token_ids")
    seq = token_ids(ids, "token_ids", limits)
    request_id = data.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise invalid(f"request_id: expected a string, got {shown(request_id)}")
    return PromptLogprobsRequest(
        [seq],
        [None],
        prompt_k,
        request_id=request_id or f"gen-{uuid.uuid4().hex}",
        ignored_fields=tuple(ignored),
    )
