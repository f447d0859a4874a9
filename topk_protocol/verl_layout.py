"""verl's teacher log-prob layout, and how our payload maps onto it.

verl's on-policy distillation asks its teacher for one sequence ``x[0..L-1]`` (the
student's prompt and response) and reads two arrays of ``[L, max(K, 1)]`` from
``TokenOutput.extra_fields``: ``prompt_ids`` and ``prompt_logprobs``
(``verl.experimental.teacher_loop.teacher_manager.AsyncTeacherLLMServerManager``). Its
vLLM teacher builds them from vLLM's prompt log-probs (``extract_prompt_logprobs`` in
``verl.workers.rollout.vllm_rollout.utils``): vLLM's first row (``None``: nothing
predicts ``x[0]``) is dropped, so **row ``j`` is the teacher's distribution of
``x[j + 1]`` given ``x[0..j]``**, and a dummy row of zeros (ids 0, log-probs 0.0) is
appended for the last position. With ``K = 0`` (verl's ``k1`` / ``k3`` losses, no top-k)
each row holds the actual next token and its log-prob; with ``K > 0`` the top-K ids and
log-probs by rank (the actual token left out unless it is among them).

Our payload's row ``t`` is the same distribution, of ``x[t + 1]`` given ``x[0..t]``
(docs/protocol.md), and its ``sampled_logprobs[t]`` the log-prob of ``x[t + 1]``: rows
``0..L-2`` carry over one for one; our last row (the token after the sequence) becomes
verl's dummy row. Pure numpy.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from topk_protocol.prompt_logprobs import payload_top_k

__all__ = ["VerlRows", "verl_rows"]

#: ``(prompt_ids [L, max(K, 1)] int32, prompt_logprobs [L, max(K, 1)] float32)``.
VerlRows = tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]


def verl_rows(
    tokens: npt.ArrayLike,
    ids: npt.ArrayLike,
    logprobs: npt.ArrayLike,
    sampled_logprobs: npt.ArrayLike,
    num_logprobs: int,
) -> VerlRows:
    """verl's ``(prompt_ids, prompt_logprobs)`` for one sequence from our payload's rows.

    Args:
        tokens: ``[L]`` the sequence's token ids.
        ids: ``[L, K']`` our top-K' ids, each row by log-prob descending (``K' >= K``).
        logprobs: ``[L, K']`` their log-probs.
        sampled_logprobs: ``[L]`` the log-prob of the actual next token (row ``L - 1``,
            which has none, is not read).
        num_logprobs: verl's K (``sampling_params["prompt_logprobs"]``), 0 for the actual
            token only.

    Returns:
        ``[L, max(K, 1)]`` int32 ids and float32 log-probs in verl's layout: row ``j < L -
        1`` the top-K of ``x[j + 1]``'s distribution (``K = 0``: ``x[j + 1]`` and its
        log-prob), row ``L - 1`` zeros.

    >>> ids, lps = verl_rows([5, 7, 9], [[7, 1], [2, 9], [3, 4]],
    ...                      [[-0.1, -2.5], [-0.4, -1.2], [-0.2, -0.3]], [-0.1, -1.2, 0.0], 0)
    >>> ids.tolist()
    [[7], [9], [0]]
    >>> print(lps.ravel())
    [-0.1 -1.2  0. ]
    """
    width = payload_top_k(num_logprobs)
    tokens = np.asarray(tokens)
    n = len(tokens)
    out_ids = np.zeros((n, width), dtype=np.int32)
    out_lps = np.zeros((n, width), dtype=np.float32)
    if n < 2:
        return out_ids, out_lps
    if num_logprobs == 0:
        out_ids[:-1, 0] = tokens[1:]
        out_lps[:-1, 0] = np.asarray(sampled_logprobs)[: n - 1]
    else:
        out_ids[:-1] = np.asarray(ids)[: n - 1, :width]
        out_lps[:-1] = np.asarray(logprobs)[: n - 1, :width]
    return out_ids, out_lps
