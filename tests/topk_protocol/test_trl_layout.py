"""TRL's ``prompt_lengths`` rule, written once for the server's HTTP routes and the
drop-in gRPC client."""

from __future__ import annotations

import numpy as np
import pytest

from topk_protocol.errors import InvalidRequestError
from topk_protocol.trl_layout import check_prompt_lengths, trl_span


def test_prompt_lengths_one_int_per_sequence_within_its_length() -> None:
    assert check_prompt_lengths([0, np.int64(2)], [3, 2]) == [0, 2]
    assert [trl_span(n, p) for n, p in zip([3, 2], [0, 2], strict=True)] == [(0, 2), (1, 1)]
    cases = [
        (None, r"^prompt_lengths: expected one int per sequence, got NoneType$"),
        ([0], r"^prompt_lengths: 1 values for 2 sequences$"),
        ([0, True], r"^prompt_lengths\[1\]: expected an int, got True$"),
        ([0, 1.0], r"^prompt_lengths\[1\]: expected an int, got 1.0$"),
        ([0, 3], r"^prompt_lengths\[1\]: 3 is outside \[0, 2\] \(the sequence's length\)$"),
        ([-1, 0], r"^prompt_lengths\[0\]: -1 is outside \[0, 3\]"),
    ]
    for value, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            check_prompt_lengths(value, [3, 2])
