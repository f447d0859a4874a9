"""The losses and the metric of `benchmarks/quality_cross_tokenizer.py`, each against a
plain reference on odd shapes (3 x 47 x 123)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from benchmarks.cross_tokenizer_arms import (
    actual_token_kl,
    binary_kl_reference,
    cross_entropy,
    masked_rows,
    nats_per_byte,
    predicted_bytes,
    topk_tail_kl,
)
from student_client.data.payload import TeacherPayload

B, T, V, K = 3, 47, 123, 5


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([T, 30, 11])
    rows = torch.arange(T)[None, :] < lengths[:, None]
    return logits, ids, rows


def _payload(masked: torch.Tensor, seed: int = 1) -> TeacherPayload:
    """A top-K payload of a random teacher over the batch's rows, NaN on ``masked``."""
    g = torch.Generator().manual_seed(seed)
    _, _, rows = _batch()
    log_p = torch.log_softmax(torch.randn(B, T, V, generator=g) * 2, -1)
    logprobs, ids = log_p.topk(K, dim=-1)
    logprobs = logprobs.masked_fill(masked[..., None], math.nan)
    logprobs = logprobs.masked_fill(~rows[..., None], 0.0)
    ids = ids.masked_fill(~rows[..., None], 0)
    return TeacherPayload(
        ids=ids,
        logprobs=logprobs,
        sampled_logprobs=None,
        mask=rows,
        position_start=torch.zeros(B, dtype=torch.int64),
        lengths=rows.sum(1),
        top_k=K,
        dtype="float32",
    )


def test_cross_entropy_is_torchs_on_the_counted_rows() -> None:
    logits, ids, rows = _batch()
    labels = ids[:, 1:].masked_fill(~rows[:, :-1], -100)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels.reshape(-1))
    got = cross_entropy(logits, ids, rows)
    assert torch.allclose(got.double(), expected, rtol=1e-6)


def test_actual_token_kl_is_the_two_outcome_kl_on_finite_rows() -> None:
    logits, ids, rows = _batch()
    g = torch.Generator().manual_seed(2)
    chain = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4 - 0.01
    chain[~rows] = math.nan
    chain[0, ::3] = math.nan  # rows the chain does not cover
    got = float(actual_token_kl(logits, ids, chain))
    logq = torch.log_softmax(logits, -1)
    terms = []
    for b in range(B):
        for t in range(T - 1):
            if math.isfinite(float(chain[b, t])):
                p = math.exp(float(chain[b, t]))
                q = math.exp(float(logq[b, t, ids[b, t + 1]]))
                terms.append(binary_kl_reference(p, q))
    assert got == pytest.approx(sum(terms) / len(terms), rel=1e-5)


def test_actual_token_kl_is_zero_where_the_student_agrees_and_moves_q_towards_p() -> None:
    logits = torch.zeros(1, 2, 4, requires_grad=True)  # q = 1/4 for every token
    ids = torch.tensor([[0, 3]])
    agree = torch.tensor([[math.log(0.25), math.nan]])
    assert float(actual_token_kl(logits, ids, agree).detach()) == pytest.approx(0.0, abs=1e-6)
    more = torch.tensor([[math.log(0.9), math.nan]])
    actual_token_kl(logits, ids, more).backward()
    assert logits.grad is not None and float(logits.grad[0, 0, 3]) < 0  # raise q(actual)


def test_masked_rows_are_the_real_rows_with_nan_logprobs() -> None:
    _, _, rows = _batch()
    masked = torch.zeros(B, T, dtype=torch.bool)
    masked[1, 3:9] = True
    assert torch.equal(masked_rows(_payload(masked)), masked & rows)


def test_topk_tail_kl_skips_the_masked_rows() -> None:
    logits, ids, rows = _batch()
    masked = rows & (torch.arange(T)[None, :] % 3 == 0)
    payload = _payload(masked)
    moved = logits.clone()
    moved[masked] += torch.randn(int(masked.sum()), V, dtype=torch.float64) * 5
    moved[1, 1, 0] += 3.0  # an answered row: the loss must see it
    base = topk_tail_kl(logits, ids, payload)
    assert not torch.allclose(topk_tail_kl(moved, ids, payload), base, rtol=1e-6)
    moved[1, 1, 0] -= 3.0
    assert torch.allclose(topk_tail_kl(moved, ids, payload), base, rtol=1e-6)


def test_predicted_bytes_skips_the_first_token() -> None:
    lengths = np.array([1, 2, 3, 4], dtype=np.int64)
    assert predicted_bytes([3, 1, 2, 2], lengths) == 2 + 3 + 3
    assert predicted_bytes([3], lengths) == 0


class _Uniform(torch.nn.Module):
    """A model with equal logits over ``vocab`` ids at every position."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, self.vocab))


def test_nats_per_byte_of_a_uniform_model_is_log_v_per_token_over_bytes() -> None:
    lengths = np.array([1, 2, 3, 4, 5, 6, 7], dtype=np.int64)
    seqs = [[0, 1, 2], [6, 5, 4, 3, 2, 1], [2]]
    tokens = 2 + 5
    nbytes = (2 + 3) + (6 + 5 + 4 + 3 + 2)
    got = nats_per_byte(_Uniform(7), seqs, lengths, batch=2)
    assert got == pytest.approx(tokens * math.log(7) / nbytes, rel=1e-6)


def test_nats_per_byte_does_not_depend_on_the_batching() -> None:
    from examples.cross_tokenizer import student_model

    model = student_model(300, seed=0)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 300, n).tolist() for n in (5, 17, 2, 33, 9)]
    lengths = rng.integers(1, 4, 300).astype(np.int64)
    one = nats_per_byte(model, seqs, lengths, batch=1)
    many = nats_per_byte(model, seqs, lengths, batch=8)
    assert many == pytest.approx(one, rel=1e-5)
    assert model.training  # restored


def test_the_modules_example_runs() -> None:
    import doctest

    import benchmarks.cross_tokenizer_arms as arms

    result = doctest.testmod(arms)
    assert result.attempted >= 3 and result.failed == 0
