"""The input rules, each written once: their limits, their messages (field and limit
named), limits read from ``TeacherInfo``, and the old names that still work, with a
warning."""

from __future__ import annotations

import numpy as np
import pytest

from topk_protocol import pb
from topk_protocol.checks import (
    TeacherLimits,
    check_depth,
    check_range,
    check_sequence_count,
    check_sequence_length,
    check_token_ids,
    check_top_k,
    check_total_tokens,
)
from topk_protocol.errors import InvalidRequestError, ResourceExhaustedError

LIMITS = TeacherLimits(
    vocab_size=512, max_top_k=64, max_tokens_per_request=100, max_sequence_length=10
)


def test_top_k_within_1_and_max_top_k_named_by_its_field() -> None:
    check_top_k(1, LIMITS)
    check_top_k(64, LIMITS)
    with pytest.raises(InvalidRequestError, match=r"^top_k: 0 is outside \[1, 64\] \(max_top_k\)$"):
        check_top_k(0, LIMITS)
    with pytest.raises(InvalidRequestError, match=r"^top_logprobs: 65 is outside \[1, 64\]"):
        check_top_k(65, LIMITS, "top_logprobs")


def test_token_ids_length_then_vocabulary() -> None:
    check_token_ids(np.array([0, 511], np.int32), LIMITS, "s")
    cases = [
        (np.zeros(0, np.int32), r"^s: empty; a sequence needs at least 1 token$"),
        (np.zeros(11, np.int32), r"^s: length 11 exceeds max_sequence_length 10$"),
        (np.array([3, 512, -1], np.int32), r"^s\[1\]: 512 is outside the vocabulary \[0, 512\)$"),
        (np.array([-1], np.int64), r"^s\[0\]: -1 is outside the vocabulary"),
    ]
    for ids, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            check_token_ids(ids, LIMITS, "s")
    # 0: no length limit.
    check_token_ids(np.zeros(1000, np.int32), TeacherLimits(512, 64), "s")


def test_counts_totals_and_ranges() -> None:
    with pytest.raises(InvalidRequestError, match=r"^sequences: empty; a request needs at least 1"):
        check_sequence_count(0)
    with pytest.raises(InvalidRequestError, match=r"^x\[2\]: empty"):
        check_sequence_length(0, "x[2]")
    check_sequence_length(10**6, "x")  # no limits given: only the lower bound
    with pytest.raises(ResourceExhaustedError, match=r"^prompt: 101 tokens in total exceeds "):
        check_total_tokens(101, LIMITS, "prompt")
    check_total_tokens(10**9, TeacherLimits(512, 64))  # 0: no limit
    check_range(0, 3, 3, "p", "the sequence")
    with pytest.raises(
        InvalidRequestError, match=r"^p: \[2, 1\) is not a range inside it \[0, 3\]$"
    ):
        check_range(2, 1, 3, "p", "it")


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2", None])
def test_depth_is_an_int_at_least_0(bad: object) -> None:
    assert check_depth(0) == 0 and check_depth(7) == 7
    with pytest.raises(ValueError, match=r"^depth: expected an int >= 0, got "):
        check_depth(bad)  # type: ignore[arg-type]


def test_limits_of_a_teachers_info() -> None:
    info = pb.TeacherInfo(
        vocab_size=512, max_top_k=64, max_tokens_per_request=100, max_sequence_length=10
    )
    assert TeacherLimits.of_info(info) == LIMITS
