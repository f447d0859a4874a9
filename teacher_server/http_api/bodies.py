"""Reading JSON request bodies of the HTTP routes, every problem an
:class:`~topk_protocol.errors.InvalidRequestError` naming the field (and the limit).

Shared by every route that turns another server's request body into a ``ScoreRequest``
(TRL's, vLLM's, SGLang's): the limits are the pipeline's
(:class:`~teacher_server.validation.Limits`), checked by the protocol's rules
(:mod:`topk_protocol.checks`), so a route says a limit in the same words as gRPC.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.validation import Limits
from topk_protocol import temperature_mismatch
from topk_protocol.checks import check_token_ids, check_total_tokens
from topk_protocol.errors import InvalidRequestError

__all__ = [
    "GRPC_ONLY",
    "UNDECLARED",
    "FieldRules",
    "IgnoredField",
    "check_temperature",
    "int_field",
    "invalid",
    "json_object",
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


#: Fields of this teacher's gRPC protocol that the framework routes do not serve, and why:
#: refused by name on every route (a client that sends one means it).
GRPC_ONLY: Mapping[str, str] = {
    "student_tokenizer": "a student of another tokenizer is served over gRPC, "
    "ScoreRequest.student_tokenizer: docs/cross_tokenizer.md",
}

#: The metric label of an ignored field the stock server does not declare either (the
#: names a client may send are unbounded; the log line names each).
UNDECLARED = "(undeclared)"


@dataclass(frozen=True)
class IgnoredField:
    """A body field accepted and ignored: its path (``sampling_params.top_p``) and its
    metric label (the path, or :data:`UNDECLARED`)."""

    path: str
    label: str


@dataclass(frozen=True)
class FieldRules:
    """What a route does with each field of a body (or of one object in it), the one rule
    every framework route follows (docs/frameworks.md, "Fields: one rule"):

    - ``read``: fields this teacher reads; the route's parser checks each.
    - ``ignored``: fields the stock server declares that change only generated tokens or
      the answer's dressing: accepted and ignored.
    - ``refused``: fields the stock server declares that would change the answer and that
      this teacher cannot honor: ``{name: why}``, refused by name unless the value is one
      that changes nothing (``null``, ``false``, an empty list or object, or the value in
      ``neutral``).
    - any other field: the stock server does not declare it. Where the stock server
      accepts and ignores such fields (vLLM's request models allow extra fields, SGLang's
      request dataclass drops them) it is accepted and ignored, labelled
      :data:`UNDECLARED`; where it rejects them (``refuse_undeclared``: SGLang's
      ``SamplingParams``) it is refused by name.
    - a field of this teacher's own protocol that no framework route serves
      (:data:`GRPC_ONLY`: ``student_tokenizer``), wherever it appears: refused by name,
      never ignored, since it would change what the ids mean.

    ``stock`` names the stock server's model in messages (``vLLM's CompletionRequest``).
    """

    stock: str
    read: frozenset[str]
    ignored: frozenset[str] = frozenset()
    refused: Mapping[str, str] = field(default_factory=dict)
    neutral: Mapping[str, Any] = field(default_factory=dict)
    refuse_undeclared: bool = False

    @property
    def declared(self) -> frozenset[str]:
        """Every field the stock model declares (read, ignored or refused here)."""
        return self.read | self.ignored | frozenset(self.refused)

    def apply(self, data: dict[str, Any], prefix: str = "") -> list[IgnoredField]:
        """Refuse ``data``'s refused fields by name; the fields it ignores."""
        out = []
        for name, value in data.items():
            if name in GRPC_ONLY and name not in self.read:
                why = GRPC_ONLY[name]
                raise invalid(f"{prefix}{name}: {shown(value)} is not served on this route ({why})")
            if name in self.read:
                continue
            if name in self.refused:
                if _changes_nothing(value) or (
                    name in self.neutral and value == self.neutral[name]
                ):
                    continue
                raise invalid(
                    f"{prefix}{name}: {shown(value)} is not supported by this teacher "
                    f"({self.refused[name]})"
                )
            path = f"{prefix}{name}"
            if name in self.ignored:
                out.append(IgnoredField(path, path))
            elif self.refuse_undeclared:
                raise invalid(
                    f"{path}: not a field of {self.stock}, which refuses it too (fields: "
                    f"{', '.join(sorted(self.declared))})"
                )
            else:
                out.append(IgnoredField(path, UNDECLARED))
        return out


def _changes_nothing(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


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
