"""`TeacherTargets`: everything the teacher side gives a loss, in one value.

Every loss (`topk_kl_loss`, `lm_head_topk_kl_loss`, `causal_lm_topk_kl_loss`,
`TopKKLLoss`, `topk_kl_reference`) takes one. A top-k payload and a sampled payload are
the same type: with `sample_counts` the loss is the sampled (unbiased) loss on the drawn
ids, without it the top-k loss. `TeacherTargets.from_payload` turns a client's
`TeacherPayload` (or a dataset batch's) into one in one call; the field names are the
payload's.

A plain class, not a dataclass or a tuple: FSDP's forward hooks look into those and cast
their float tensors under a mixed-precision policy, and the teacher's log-probs must
reach the loss as given (`lm_head_topk_kl.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["TeacherTargets"]

_TENSORS = (
    "ids",
    "logprobs",
    "mask",
    "sampled_ids",
    "sampled_logprobs",
    "candidate_ids",
    "candidate_logprobs",
    "sample_counts",
    "proposal_log_normalizer",
)


class TeacherTargets:
    """The teacher's side of one loss call (`[...]` the student's positions, e.g. `[B, T]`).

    Attributes:
        ids: `[..., K]` global vocabulary ids, any integer dtype: the teacher's top-k,
            distinct within a position; for a sampled payload the distinct drawn ids
            (columns with count 0 are padding and may hold anything).
        logprobs: `[..., K]` the teacher's log-probs at `ids`, any float dtype, `<= 0`.
        mask: `[...]` bool or 0/1, the positions that count; None: all of them.
        sampled_ids: `[...]` the actual next token of each position (`input_ids[:, t + 1]`;
            any id where there is none); mode "tail_actual" only.
        sampled_logprobs: `[...]` the teacher's log-prob of that token (the payload's
            `sampled_logprobs`, NaN where there is no next token); mode "tail_actual" only.
        candidate_ids: `[..., C]` global ids the student named per position (-1 pads a
            row); supports "student" / "union" only.
        candidate_logprobs: `[..., C]` the teacher's log-probs at them (NaN at -1).
        sample_counts: `[..., K]` a sampled payload's draws of each column's id (a row
            sums to N; 0: padding). Given, the loss is the sampled loss (forward KL on an
            unbiased target); any non-negative numbers work (a row is divided by its sum).
        proposal_log_normalizer: `[...]` `log Z` of a tempered proposal, needed when
            `proposal_temperature != 1`.
        proposal_temperature: `tau` the draws were made at (1: from the teacher's `p`).
    """

    __slots__ = (*_TENSORS, "proposal_temperature")

    def __init__(
        self,
        ids: Tensor,
        logprobs: Tensor,
        *,
        mask: Tensor | None = None,
        sampled_ids: Tensor | None = None,
        sampled_logprobs: Tensor | None = None,
        candidate_ids: Tensor | None = None,
        candidate_logprobs: Tensor | None = None,
        sample_counts: Tensor | None = None,
        proposal_log_normalizer: Tensor | None = None,
        proposal_temperature: float = 1.0,
    ) -> None:
        self.ids = ids
        self.logprobs = logprobs
        self.mask = mask
        self.sampled_ids = sampled_ids
        self.sampled_logprobs = sampled_logprobs
        self.candidate_ids = candidate_ids
        self.candidate_logprobs = candidate_logprobs
        self.sample_counts = sample_counts
        self.proposal_log_normalizer = proposal_log_normalizer
        self.proposal_temperature = proposal_temperature

    @property
    def is_sampled(self) -> bool:
        """Whether this is a sampled payload (the loss then uses the drawn ids' weights)."""
        return self.sample_counts is not None

    @classmethod
    def from_payload(
        cls, payload: Any, *, input_ids: Tensor | None = None, mask: Tensor | None = None
    ) -> TeacherTargets:
        """A client's `TeacherPayload` aligned to a batch (`ids` `[B, T, K]`, ...) as the
        losses' teacher value. Read by attribute name, so anything with the payload's
        fields works.

        Args:
            payload: the payload (`ids`, `logprobs`, `mask`, and when present
                `sampled_logprobs`, `candidate_ids`, `candidate_logprobs`,
                `sample_counts`, `proposal_log_normalizer`, `proposal_temperature`).
            input_ids: `[B, T]` the batch's tokens: with the payload's `sampled_logprobs`
                they give `sampled_ids` (`input_ids` shifted left by one) for mode
                "tail_actual".
            mask: `[B, T]` replaces the payload's mask (e.g. the payload's mask and the
                batch's own).
        """
        sampled_logprobs = getattr(payload, "sampled_logprobs", None)
        sampled_ids = None
        if sampled_logprobs is not None and input_ids is not None:
            sampled_ids = torch.roll(input_ids, -1, dims=-1)  # the last column: no next token
        return cls(
            payload.ids,
            payload.logprobs,
            mask=payload.mask if mask is None else mask,
            sampled_ids=sampled_ids,
            sampled_logprobs=sampled_logprobs if sampled_ids is not None else None,
            candidate_ids=getattr(payload, "candidate_ids", None),
            candidate_logprobs=getattr(payload, "candidate_logprobs", None),
            sample_counts=getattr(payload, "sample_counts", None),
            proposal_log_normalizer=getattr(payload, "proposal_log_normalizer", None),
            proposal_temperature=float(getattr(payload, "proposal_temperature", 1.0)),
        )

    def apply(self, fn: Callable[[Tensor], Tensor]) -> TeacherTargets:
        """The same value with `fn` applied to every tensor (e.g. `lambda t: t[rows]`)."""
        out = TeacherTargets.__new__(TeacherTargets)
        for name in _TENSORS:
            value = getattr(self, name)
            setattr(out, name, None if value is None else fn(value))
        out.proposal_temperature = self.proposal_temperature
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TeacherTargets:
        """The same value with every tensor on `device`."""
        return self.apply(lambda t: t.to(device, non_blocking=non_blocking))

    def __repr__(self) -> str:
        given = [
            f"{name}={list(value.shape)}"
            for name in _TENSORS
            if (value := getattr(self, name)) is not None
        ]
        tau = self.proposal_temperature
        return f"TeacherTargets({', '.join(given)}, proposal_temperature={tau})"
