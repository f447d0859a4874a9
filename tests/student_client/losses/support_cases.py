"""Test helpers: the student's candidate ids of a problem, with every awkward case.

Rows cycle through six kinds: a fully padded row (all -1), a partly padded one, candidates
that repeat teacher top-k ids, candidates that repeat each other, candidates that are
exactly the teacher's top-k, and the student's own top-C (the on-policy case, which most
rows start from). The log-probs are the teacher's at those ids, NaN where the id is -1.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from student_client.losses.types import SUPPORTS

__all__ = ["ROW_KINDS", "SUPPORTS", "make_candidates"]

ROW_KINDS = ("padded", "partly padded", "top-k repeats", "own repeats", "the top-k", "own top-C")


def make_candidates(
    logits: Tensor, ids: Tensor, teacher_full: Tensor, width: int, *, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """`(candidate_ids [N, C] int64, candidate_logprobs [N, C] float64)` for `logits`
    `[N, V]`, the teacher's top-k `ids` `[N, K]` and full log-probs `[N, V]`."""
    n_rows, vocab = logits.shape
    top_k = ids.shape[1]
    generator = torch.Generator().manual_seed(seed)
    candidates = logits.double().topk(width, dim=-1).indices.clone()
    for row in range(n_rows):
        kind = ROW_KINDS[row % len(ROW_KINDS)]
        if kind == "padded":
            candidates[row] = -1
        elif kind == "partly padded":
            candidates[row, width - 3 :] = -1
            candidates[row, 0] = int(torch.randint(0, vocab, (1,), generator=generator))
        elif kind == "top-k repeats":
            candidates[row, 1] = ids[row, 0]
            candidates[row, width - 1] = ids[row, top_k - 1]
        elif kind == "own repeats":
            candidates[row, 3] = candidates[row, 0]
            candidates[row, 4] = candidates[row, 0]
            candidates[row, width - 1] = candidates[row, 2]
        elif kind == "the top-k":
            candidates[row] = -1
            candidates[row, : min(top_k, width)] = ids[row, :width]
    known = candidates >= 0
    logprobs = teacher_full.double().gather(1, candidates.clamp_min(0))
    return candidates, torch.where(known, logprobs, math.nan)
