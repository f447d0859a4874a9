"""``ScoreBatch``: one item of a client's ``stream`` (a batch and what goes with it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from topk_protocol import RequestOptions

__all__ = ["ScoreBatch"]


@dataclass(frozen=True)
class ScoreBatch:
    """One item of ``stream`` when positions or a mask are needed.

    ``sequences``: the batch (``[B, L]``, a list of 1-D id sequences, or a
    ``BatchEncoding`` / dict with ``input_ids``); ``positions``: one ``(start, end)`` per
    sequence (None: every position); ``attention_mask``: ``[B, T]`` (see
    :meth:`~student_client.clients.aio.AsyncTeacherClient.score`); ``teacher``: the teacher
    of each sequence (a name per sequence, or one name for all) for a multi-teacher client
    (:mod:`student_client.clients.multi`; a single-teacher client ignores it);
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
