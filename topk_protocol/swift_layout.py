"""ms-swift's teacher log-prob layout, and how our payload maps onto it.

ms-swift's distillation (GKD, and OPD-RL in its GRPO trainer) asks a teacher server for
``prompt_logprobs`` over one rendered sequence ``x[0..L-1]`` and reads them with
``parse_prompt_logprobs`` (``swift.rlhf_trainers.utils``, ms-swift 4.6.0). Its server
hands them in vLLM's form, each position's entries keyed by the token id as a string
(``VllmEngine._format_prompt_logprobs``): a list of ``L`` entries, entry 0 ``None``
(nothing predicts ``x[0]``) and **entry ``p`` the teacher's distribution of ``x[p]``
given ``x[0..p-1]``**, a dict ``{str(token_id): {"logprob": float, "rank": int | None}}``.
Asked for ``K = 0`` (OPD-RL), an entry holds the actual token ``x[p]`` alone; asked for
``K > 0`` (GKD), ``x[p]`` first, then the top K by rank (rank 1 first; ``x[p]`` keeps its
first place and takes its top-K rank when it is among them), as vLLM builds it
(``vllm.logprobs.append_logprobs_for_next_position``). swift keeps the first entry for
``K = 0`` and the K largest log-probs for ``K > 0``.

Our payload's row ``t`` is the distribution of ``x[t + 1]`` given ``x[0..t]``
(docs/protocol.md) and ``sampled_logprobs[t]`` the log-prob of ``x[t + 1]``: swift's
entry ``p`` is our row ``p - 1``; our last row (the token after the sequence) has no
place. An actual token outside our top K' has no known rank here: its ``rank`` is
``None``, as swift's server writes for an entry without one. vLLM's ``decoded_token``
is not written (nothing in swift's teacher path reads it). Pure Python over numpy rows.
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np
import numpy.typing as npt

__all__ = ["PromptLogprob", "PromptLogprobs", "prompt_logprobs"]


class PromptLogprob(TypedDict):
    """One token's entry at one position, as swift's server writes it."""

    logprob: float
    #: 1 for the most likely token; None where not known (the actual token outside the
    #: top K).
    rank: int | None


#: ``[L]`` entries: ``None`` at position 0, then ``{str(token_id): PromptLogprob}``.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def prompt_logprobs(
    tokens: npt.ArrayLike,
    ids: npt.ArrayLike,
    logprobs: npt.ArrayLike,
    sampled_logprobs: npt.ArrayLike,
    num_logprobs: int,
) -> PromptLogprobs:
    """swift's ``prompt_logprobs`` for one sequence from our payload's rows.

    Args:
        tokens: ``[L]`` the sequence's token ids.
        ids: ``[L, K']`` our top-K' ids, each row by log-prob descending (``K' >= K``).
        logprobs: ``[L, K']`` their log-probs.
        sampled_logprobs: ``[L]`` the log-prob of the actual next token (row ``L - 1``
            is not read).
        num_logprobs: swift's K (``RequestConfig.prompt_logprobs``), 0 for the actual
            token only.

    Returns:
        ``L`` entries: ``None``, then for ``p`` in ``1..L-1`` ``x[p]`` and the top-K of
        its distribution by rank (``K = 0``: ``x[p]`` alone).

    >>> prompt_logprobs([5, 7, 9], [[7, 1], [2, 9], [3, 4]],
    ...                 [[-0.5, -2.0], [-0.25, -1.5], [-0.125, -3.0]], [-0.5, -1.5, 0.0], 1)
    [None, {'7': {'logprob': -0.5, 'rank': 1}}, {'9': {'logprob': -1.5, 'rank': None}, '2': {'logprob': -0.25, 'rank': 1}}]
    """  # noqa: E501
    tokens = np.asarray(tokens)
    n = len(tokens)
    actual = tokens[1:].tolist()
    sampled = np.asarray(sampled_logprobs, dtype=np.float64)[: n - 1].tolist()
    out: PromptLogprobs = [None]
    if num_logprobs == 0:
        best = np.asarray(ids)[: n - 1, 0].tolist()
        out += [
            {str(token): {"logprob": lp, "rank": 1 if top == token else None}}
            for token, lp, top in zip(actual, sampled, best, strict=True)
        ]
        return out
    top_ids = np.asarray(ids)[: n - 1, :num_logprobs].tolist()
    top_lps = np.asarray(logprobs, dtype=np.float64)[: n - 1, :num_logprobs].tolist()
    for row_ids, row_lps, token, lp in zip(top_ids, top_lps, actual, sampled, strict=True):
        entry: dict[str, PromptLogprob] = {str(token): {"logprob": lp, "rank": None}}
        for rank, (i, v) in enumerate(zip(row_ids, row_lps, strict=True), start=1):
            entry[str(i)] = {"logprob": v, "rank": rank}
        out.append(entry)
    return out
