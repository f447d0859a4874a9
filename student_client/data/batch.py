"""``ScoreBatch``: one item of a client's ``stream`` (a batch and what goes with it), and
the keywords every client's ``score`` / ``stream`` takes, listed once.

:class:`ScoreKeywords` (and :class:`LiveScoreKeywords`, with ``timeout_s``) is the one
list of ``score``'s keywords: what goes with the batch (:class:`BatchKeywords`) and the
request options (:class:`~topk_protocol.requests.RequestKeywords`). Every client's
signature unpacks it (``**keywords: Unpack[ScoreKeywords]``), so an IDE lists them and a
type checker checks them, and :func:`split_call` turns them into a :class:`ScoreCall`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict

import torch

from topk_protocol import RequestOptions
from topk_protocol.requests import RequestKeywords

__all__ = [
    "AnswerKeywords",
    "BatchKeywords",
    "LiveScoreKeywords",
    "LiveStreamKeywords",
    "ScoreBatch",
    "ScoreCall",
    "ScoreKeywords",
    "StreamCall",
    "StreamKeywords",
    "split_call",
    "split_device",
    "split_stream",
]


@dataclass(frozen=True)
class ScoreBatch:
    """One item of ``stream`` when positions or a mask are needed.

    ``sequences``: the batch (``[B, L]``, a list of 1-D id sequences, or a
    ``BatchEncoding`` / dict with ``input_ids``); ``positions``: one ``(start, end)`` per
    sequence (None: every position); ``attention_mask``: ``[B, T]`` (see
    :meth:`~student_client.clients.aio.AsyncTeacherClient.score`); ``teacher``: the teacher
    of each sequence (a name per sequence, or one name for all) for a multi-teacher client
    (:mod:`student_client.clients.multi_teacher`; a single-teacher client ignores it);
    ``candidate_ids``: ids whose teacher log-probs to fetch at every scored position,
    ``[B, S, C]`` laid out like the payload the call returns (row ``j`` of sequence ``b``
    is position ``positions[b][0] + j``; with an attention mask, column ``t`` of the
    padded batch), ``-1`` padding; or one ``[S_b, C]`` per sequence without a mask
    (see :meth:`~student_client.clients.aio.AsyncTeacherClient.score`);
    ``options``: request options for this batch only, over the call's
    (``RequestOptions.of`` keywords, e.g. ``{"encoding": "packed", "logprob_bits": 8}``).
    """

    sequences: Any
    positions: Sequence[tuple[int, int]] | None = None
    attention_mask: Any = None
    teacher: Any = None
    candidate_ids: Any = None
    options: Mapping[str, Any] | None = None

    def request_options(self, call: RequestOptions) -> RequestOptions:
        """The options this batch is asked with: the call's, with :attr:`options` over them."""
        return RequestOptions.of(call, **self.options) if self.options else call


class BatchKeywords(TypedDict, total=False):
    """What goes with a batch in ``score``, by keyword (the fields of
    :class:`ScoreBatch` besides the sequences, and where the payload goes): ``positions``,
    ``attention_mask``, ``teacher``, ``candidate_ids`` as :class:`ScoreBatch`; ``device``
    the payload's tensors' device (default ``"cpu"``)."""

    positions: Sequence[tuple[int, int]] | None
    attention_mask: Any
    teacher: Any
    candidate_ids: Any
    device: torch.device | str


class ScoreKeywords(BatchKeywords, RequestKeywords, total=False):
    """Every keyword of a client's ``score``: the batch's and the request options."""


class LiveScoreKeywords(ScoreKeywords, total=False):
    """A live client's ``score`` keywords: :class:`ScoreKeywords` and ``timeout_s``, the
    call's deadline in seconds (None: the client's)."""

    timeout_s: float | None


class StreamKeywords(RequestKeywords, total=False):
    """Every keyword of a client's ``stream``: ``device`` (as in ``score``), ``depth``
    (requests ahead, default 4) and the request options."""

    device: torch.device | str
    depth: int


class AnswerKeywords(RequestKeywords, total=False):
    """A live client's ``stream_answers`` keywords: ``depth``, ``timeout_s`` and the
    request options (the answers are not decoded: no device)."""

    depth: int
    timeout_s: float | None


class LiveStreamKeywords(StreamKeywords, total=False):
    """A live client's ``stream`` keywords: :class:`StreamKeywords` and ``timeout_s``
    (per request, from when it is sent)."""

    timeout_s: float | None


class ScoreCall(NamedTuple):
    """A ``score`` call's keywords, split: the batch, the payload's device, the deadline
    (None: the client's) and the request options."""

    batch: ScoreBatch
    device: torch.device | str
    timeout_s: float | None
    options: RequestKeywords


def split_call(sequences: Any, keywords: Mapping[str, Any]) -> ScoreCall:
    """``score(sequences, top_k, **keywords)``'s keywords as a :class:`ScoreCall`."""
    rest = dict(keywords)
    device = rest.pop("device", "cpu")
    timeout_s = rest.pop("timeout_s", None)
    batch = ScoreBatch(sequences, **{k: rest.pop(k) for k in _BATCH_FIELDS if k in rest})
    return ScoreCall(batch, device, timeout_s, rest)  # type: ignore[arg-type]


#: The :class:`BatchKeywords` that are fields of :class:`ScoreBatch`.
_BATCH_FIELDS = ("positions", "attention_mask", "teacher", "candidate_ids")


class StreamCall(NamedTuple):
    """A ``stream`` call's keywords, split: the payloads' device, the requests ahead, the
    per-request deadline (None: the client's) and the request options."""

    device: torch.device | str
    depth: int
    timeout_s: float | None
    options: RequestKeywords


def split_device(keywords: Mapping[str, Any]) -> tuple[torch.device | str, AnswerKeywords]:
    """``stream``'s keywords as (the payloads' device, ``stream_answers``' keywords)."""
    rest = dict(keywords)
    return rest.pop("device", "cpu"), rest  # type: ignore[return-value]


def split_stream(keywords: Mapping[str, Any]) -> StreamCall:
    """``stream(batches, top_k, **keywords)``'s keywords as a :class:`StreamCall`."""
    rest = dict(keywords)
    device = rest.pop("device", "cpu")
    depth = rest.pop("depth", 4)
    timeout_s = rest.pop("timeout_s", None)
    return StreamCall(device, depth, timeout_s, rest)  # type: ignore[arg-type]
