"""Reading JSON request bodies of the HTTP routes, every problem an
:class:`~topk_protocol.errors.InvalidRequestError` naming the field (and the limit).

Shared by every route that turns another server's request body into a ``ScoreRequest``
(TRL's, vLLM's, SGLang's): the limits are the pipeline's
(:class:`~teacher_server.validation.Limits`), checked by the protocol's rules
(:mod:`topk_protocol.checks`), so a route says a limit in the same words as gRPC.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.validation import Limits
from topk_protocol import temperature_mismatch
from topk_protocol.checks import check_token_ids, check_total_tokens
from topk_protocol.errors import InvalidRequestError

__all__ = [
    "check_temperature",
    "int_field",
    "invalid",
    "json_object",
    "refuse_unknown",
    "shown",
    "token_id_lists",
    "token_ids",
]


def invalid(message: str) -> InvalidRequestError:
    """The error of a request field (``message`` starts with the field's name)."""
    return InvalidRequestError(message)


def shown(value: Any) -> str:
    """A value as JSON, cut to 40 characters (for a message)."""
    return json.dumps(value)[:40]


def json_object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"body: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise invalid(f"body: expected a JSON object, got {type(data).__name__}")
    return data


def refuse_unknown(
    data: dict[str, Any], known: frozenset[str], route: str, prefix: str = ""
) -> None:
    """An unknown key of `data` (a body, or the object at field path `prefix`) refused by
    name, with the keys `route` reads."""
    extra = sorted(set(data) - known)
    if extra:
        raise invalid(
            f"{prefix}{extra[0]}: not supported by this teacher's {route} (it serves prompt "
            f"log-probs only; fields read: {', '.join(sorted(known))})"
        )


def int_field(data: dict[str, Any], name: str, default: int | None = None) -> int:
    value = data.get(name, default)
    if value is None:
        raise invalid(f"{name}: missing; expected an int")
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name}: expected an int, got {shown(value)}")
    return value


def token_ids(seq: Any, field: str, limits: Limits) -> npt.NDArray[np.int32]:
    """One JSON list of token ids -> ``[L]`` int32, every problem named ``field[j]``."""
    if not isinstance(seq, list):
        raise invalid(f"{field}: expected a list of token ids, got {shown(seq)}")
    arr = np.asarray(seq) if seq else np.zeros(0, np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        for j, v in enumerate(seq):
            if isinstance(v, bool) or not isinstance(v, int):
                raise invalid(f"{field}[{j}]: expected a token id (int), got {shown(v)}")
    check_token_ids(arr, limits, field)
    return arr.astype(np.int32)


def check_temperature(data: dict[str, Any], served: float) -> None:
    """The request's ``temperature`` (if given) must be the served teacher temperature."""
    if "temperature" not in data or data["temperature"] is None:
        return
    t = data["temperature"]
    if isinstance(t, bool) or not isinstance(t, int | float):
        raise invalid(f"temperature: expected a number, got {shown(t)}")
    refusal = temperature_mismatch(t, served)
    if refusal is not None:
        raise invalid(refusal)


def token_id_lists(value: Any, field: str, limits: Limits) -> list[npt.NDArray[np.int32]]:
    if value is None:
        raise invalid(f"{field}: missing; expected a list of token id lists")
    if not isinstance(value, list) or not value:
        raise invalid(f"{field}: expected a non-empty list of token id lists")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        value = [value]  # vLLM's single token-id prompt
    check_total_tokens(sum(len(v) if isinstance(v, list) else 0 for v in value), limits, field)
    return [token_ids(v, f"{field}[{i}]", limits) for i, v in enumerate(value)]
