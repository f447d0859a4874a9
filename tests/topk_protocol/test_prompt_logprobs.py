"""The K our teacher is asked for when a trainer asks for vLLM's prompt log-probs."""

from __future__ import annotations

import pytest

from topk_protocol.errors import InvalidRequestError
from topk_protocol.prompt_logprobs import payload_top_k


def test_zero_asks_for_one_and_k_for_k() -> None:
    assert payload_top_k(0) == 1 and payload_top_k(1) == 1 and payload_top_k(64) == 64


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8", None])
def test_bad_prompt_logprobs_name_the_field(bad: object) -> None:
    with pytest.raises(InvalidRequestError, match=r"^prompt_logprobs: expected an int >= 0"):
        payload_top_k(bad)  # type: ignore[arg-type]
