"""The log-prob of each aligned student token from the teacher's actual-token log-probs.

An ``ALIGNED`` student row ``t`` (:mod:`.boundaries`) is teacher row ``j =
teacher_row[t]``, and its next token ``x[t+1]`` spells exactly the teacher tokens
``y[j+1..j']`` (``j' = chain_stop[t]``). By the chain rule, the teacher's probability of
that token is the product of the teacher's probabilities of those tokens, each given the
ones before it::

    log p(x[t+1] | x[..t]) = sum_{i=j}^{j'-1} s[i],   s[i] = log p(y[i+1] | y[..i])

where ``s`` is the teacher's ``sampled_logprobs`` (row ``i``: the log-prob of the
teacher's next actual token). Example: student ``a | bcd``, teacher ``a | b | c | d``:
row 0's chain is ``s[0] + s[1] + s[2] = log p(b | a) + log p(c | ab) + log p(d | abc)``.
When both tokenizers agree on a token (``j' = j + 1``), it is ``s[j]`` itself.

Only the teacher's own tokenization of the bytes is summed: the other ways the teacher
could spell the same bytes are not (their probability is not in the teacher's answer),
so the chain is the probability of the bytes spelled as the teacher spells them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from teacher_server.alignment.boundaries import Alignment

__all__ = ["chain_logprobs"]


def chain_logprobs(
    alignment: Alignment, teacher_sampled_logprobs: npt.ArrayLike
) -> npt.NDArray[np.float64]:
    """The chain-rule log-prob of every aligned student row's next token.

    Args:
        alignment: the sequence's :class:`~.boundaries.Alignment` (``Ls`` student rows,
            ``Lt`` teacher rows).
        teacher_sampled_logprobs: ``[Lt]`` floats, row ``i`` = ``log p(y[i+1] | y[..i])``
            (the teacher's last row, which has no next token, is never summed: NaN there
            as in the payload is fine).

    Returns:
        ``[Ls]`` float64: row ``t``'s next-token log-prob where ``alignment.aligned[t]``,
        NaN elsewhere (as the payload's ``sampled_logprobs`` has NaN where there is no
        value). Each sum is taken in float64 over its own teacher rows
        (``np.add.reduceat``), so long sequences lose no precision.

    Raises:
        ValueError: ``teacher_sampled_logprobs`` is not ``[Lt]``.
    """
    sampled = np.asarray(teacher_sampled_logprobs, dtype=np.float64)
    rows = alignment.teacher_ends.shape[0]
    if sampled.shape != (rows,):
        raise ValueError(
            f"teacher_sampled_logprobs: expected [Lt] = ({rows},), got {sampled.shape}"
        )
    out = np.full(alignment.teacher_row.shape, np.nan, dtype=np.float64)
    aligned = np.flatnonzero(alignment.aligned)
    if aligned.size == 0:
        return out
    start = alignment.teacher_row[aligned]
    stop = alignment.chain_stop[aligned]
    # reduceat over [start_0, stop_0, start_1, stop_1, ...] (every index < Lt: a stop is
    # a student row's teacher row): the even segments are the chains (start < stop); the
    # odd ones, the gaps between chains and the last stop's run to the end of the array,
    # are dropped.
    bounds = np.empty(2 * aligned.size, dtype=np.int64)
    bounds[0::2] = start
    bounds[1::2] = stop
    sums = np.add.reduceat(sampled, bounds)
    out[aligned] = sums[0::2]
    return out
