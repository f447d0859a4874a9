"""Text prompts: tokenized by the teacher's own tokenizer (the backend's), the ids then
checked like any request's (:func:`topk_protocol.checks.check_token_ids`)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.http_api.bodies import invalid, shown
from teacher_server.validation import Limits
from topk_protocol.checks import check_token_ids

__all__ = ["TokenTexts", "encode_text"]


def encode_text(
    text: Any, tokenizer: Any | None, field: str, limits: Limits
) -> npt.NDArray[np.int32]:
    """``text`` as the teacher's tokenizer encodes it (special tokens added as the
    tokenizer's ``encode`` adds them by default, as vLLM's and SGLang's servers do) ->
    ``[L]`` int32. Refused, naming ``field``: not a string, no tokenizer on this backend,
    a text the tokenizer cannot encode or that encodes to no token, ids outside the
    vocabulary or a sequence over the length limit."""
    if not isinstance(text, str):
        raise invalid(f"{field}: expected a string, got {shown(text)}")
    if tokenizer is None:
        raise invalid(f"{field}: this teacher's backend has no tokenizer; send token ids")
    try:
        ids = tokenizer.encode(text)
    except Exception as e:  # the tokenizer's own refusal, whatever its kind
        raise invalid(f"{field}: the teacher's tokenizer cannot encode it ({e})") from None
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size == 0:
        raise invalid(f"{field}: {shown(text)} encodes to no token")
    check_token_ids(arr, limits, field)
    return arr.astype(np.int32)


class TokenTexts:
    """Each token id's text as vLLM's server writes it in ``decoded_token`` and in a
    completion's ``logprobs.tokens`` (``tokenizer.decode([id])``), decoded once per id
    and kept (at most the vocabulary), with its JSON string form.

    Safe across the worker threads that render answers: an entry may be decoded twice
    by two threads at once, never wrongly."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._json: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        """The id's text."""
        found = self._text.get(token_id)
        if found is None:
            found = self._tokenizer.decode([token_id]) or ""
            self._text[token_id] = found
        return found

    def json(self, token_id: int) -> str:
        """The id's text as a JSON string (quotes included)."""
        found = self._json.get(token_id)
        if found is None:
            found = json.dumps(self.text(token_id), ensure_ascii=False)
            self._json[token_id] = found
        return found

    def decode(self, ids: npt.NDArray[np.int32]) -> str:
        """A prompt's text from its ids (``tokenizer.decode``)."""
        text: str = self._tokenizer.decode(ids.tolist())
        return text
