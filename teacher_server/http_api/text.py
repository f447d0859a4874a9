"""Text prompts: tokenized by the teacher's own tokenizer (the backend's), the ids then
checked like any request's (:func:`topk_protocol.checks.check_token_ids`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.http_api.bodies import invalid, shown
from teacher_server.validation import Limits
from topk_protocol.checks import check_token_ids

__all__ = ["encode_text"]


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
