"""vLLM's ``prompt_logprobs`` count, as trainers ask a teacher for it, in our terms.

verl and ms-swift ask their teachers for vLLM's prompt log-probs with one number ``K``:
0 for the log-prob of each actual token only (their k1 / k3 and OPD-RL losses), ``K >
0`` for the top K at each position (top-k distillation). Our teacher's K is at least 1
and it sends the actual token's log-prob beside the top K (``include_sampled``), so
``K = 0`` is served by asking for K = 1 and reading the actual token's column.
"""

from __future__ import annotations

from topk_protocol.errors import InvalidRequestError

__all__ = ["payload_top_k"]


def payload_top_k(num_logprobs: int) -> int:
    """The K to ask our teacher for when a trainer asks for ``num_logprobs`` prompt
    log-probs: K itself, or 1 for ``K = 0``. Raises
    :class:`~topk_protocol.errors.InvalidRequestError` naming ``prompt_logprobs``.

    >>> payload_top_k(0), payload_top_k(64)
    (1, 64)
    """
    if isinstance(num_logprobs, bool) or not isinstance(num_logprobs, int) or num_logprobs < 0:
        raise InvalidRequestError(
            f"prompt_logprobs: expected an int >= 0 (the top-k, 0 for the actual token "
            f"only), got {num_logprobs!r}"
        )
    return max(num_logprobs, 1)
