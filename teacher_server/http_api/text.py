"""Text prompts: tokenized by the teacher's own tokenizer (the backend's), the ids then
checked like any request's (:func:`topk_protocol.checks.check_token_ids`)."""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.http_api.bodies import invalid, shown
from teacher_server.http_api.json_arrays import Cells, padded_strings, table_cells
from teacher_server.validation import Limits
from topk_protocol.checks import check_token_ids

__all__ = ["LazyTokenTexts", "TokenTexts", "encode_text"]


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
    by two threads at once, never wrongly; the table of JSON strings
    (:meth:`json_cells`) is replaced whole, under a lock, when ids are added."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._json: dict[int, str] = {}
        # Each decoded id's JSON string: characters [ids, longest], length (-1: not yet).
        self._table = (np.zeros((0, 0), dtype=np.uint8), np.zeros(0, dtype=np.int64))
        self._lock = threading.Lock()

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

    def json_cells(self, ids: npt.NDArray[np.int32]) -> Cells:
        """The JSON strings of ``ids`` (>= 0, any shape, read row-major), a row each,
        UTF-8: rows of a table kept by id (:func:`table_cells`), an id new to it
        decoded once."""
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        chars, lengths = self._table
        if flat.size and (int(flat.max()) >= lengths.size or (lengths[flat] < 0).any()):
            chars, lengths = self._grow(flat)
        return table_cells(chars, lengths, flat)

    def _grow(
        self, ids: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
        """The table with ``ids`` in it: a new one (a table once published is never
        changed; a render may be reading it)."""
        with self._lock:
            chars, lengths = self._table
            size = max(lengths.size, int(ids.max()) + 1)
            lengths = np.concatenate([lengths, np.full(size - lengths.size, -1, np.int64)])
            new = np.unique(ids[lengths[ids] < 0])
            added, added_lengths = padded_strings([self.json(t).encode() for t in new.tolist()])
            width = max(chars.shape[1], added.shape[1])
            grown = np.zeros((size, width), dtype=np.uint8)
            grown[: chars.shape[0], : chars.shape[1]] = chars
            grown[new, : added.shape[1]] = added
            lengths[new] = added_lengths
            self._table = (grown, lengths)
            return self._table

    def decode(self, ids: npt.NDArray[np.int32]) -> str:
        """A prompt's text from its ids (``tokenizer.decode``)."""
        text: str = self._tokenizer.decode(ids.tolist())
        return text


class LazyTokenTexts:
    """A route's :class:`TokenTexts` of the backend's tokenizer, made on first use (the
    tokenizer is there once the backend has loaded); None where the backend has none."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._texts: TokenTexts | None = None

    def get(self) -> TokenTexts | None:
        tokenizer = self._backend.tokenizer
        if tokenizer is None:
            return None
        if self._texts is None:
            self._texts = TokenTexts(tokenizer)
        return self._texts
