"""`lm_head_topk_kl_loss` against a float64 dense oracle and against `topk_kl_loss`.

The oracle forms the logits densely, `hidden @ W.T + b` in float64, and differentiates the
independent dense loss of `losses_oracle` with autograd: loss, `grad_hidden`, `grad_weight`,
`grad_bias`.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from student_client.losses import (
    LossOptions,
    TeacherTargets,
    lm_head_topk_kl_loss,
    topk_kl_loss,
)
from student_client.losses.types import LossMode, Reduction
from tests.student_client.losses.calls import teacher_and_options
from tests.student_client.losses.losses_oracle import oracle_loss, oracle_rows

LEAD, HIDDEN, VOCAB, TOP_K = (3, 47), 37, 123, 7  # N = 141: odd everywhere


def _problem(seed: int, dtype: torch.dtype = torch.float64, lead=LEAD, vocab=VOCAB):
    """hidden `[*lead, H]`, weight `[V, H]`, bias `[V]`, teacher ids / log-probs, mask."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, HIDDEN, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, HIDDEN, generator=generator, dtype=torch.float64) * 0.5
    bias = torch.randn(vocab, generator=generator, dtype=torch.float64)
    teacher = torch.log_softmax(
        torch.randn(*lead, vocab, generator=generator, dtype=torch.float64) * 3, -1
    )
    logprobs, ids = torch.topk(teacher, TOP_K, dim=-1)
    n_rows = math.prod(lead)
    mask = torch.rand(n_rows, generator=generator) > 0.3
    mask[7:28] = False  # whole chunks of 7 rows (and most of one of 64... no: rows 7..27)
    mask[0] = True
    return (
        hidden.to(dtype),
        weight.to(dtype),
        bias.to(dtype),
        ids,
        logprobs,
        mask.reshape(lead),
    )


def _fused_grads(hidden, weight, bias, ids, logprobs, **kwargs):
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    loss, stats = lm_head_topk_kl_loss(
        (leaves[1], leaves[2]), leaves[0], *teacher_and_options(ids, logprobs, **kwargs)
    )
    loss.sum().backward()
    return loss.detach(), stats, [leaf.grad for leaf in leaves]


def _oracle_grads(hidden, weight, bias, ids, logprobs, *, mask, mode, reduction, **kwargs):
    leaves = [t.detach().double().requires_grad_(True) for t in (hidden, weight, bias)]
    logits = leaves[0] @ leaves[1].T + leaves[2]
    loss = oracle_loss(logits, ids, logprobs, mode=mode, mask=mask, reduction=reduction, **kwargs)
    loss.sum().backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


MODES: tuple[LossMode, ...] = ("tail", "truncated")
REDUCTIONS: tuple[Reduction, ...] = ("mean", "sum", "none")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("grad_in_forward", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000, None])
def test_matches_float64_dense_oracle(mode, reduction, grad_in_forward, chunk_size) -> None:
    hidden, weight, bias, ids, logprobs, mask = _problem(seed=1)
    options = {"mode": mode, "reduction": reduction, "temperature": 0.7}
    loss, stats, grads = _fused_grads(
        hidden,
        weight,
        bias,
        ids,
        logprobs,
        mask=mask,
        chunk_size=chunk_size,
        grad_in_forward=grad_in_forward,
        **options,
    )
    want, want_grads = _oracle_grads(hidden, weight, bias, ids, logprobs, mask=mask, **options)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    for name, got, expected in zip(("hidden", "weight", "bias"), grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12, msg=name)
    assert grads[0] is not None
    assert bool((grads[0][~mask] == 0).all())  # masked rows get no gradient
    assert stats.positions == int(mask.sum())


@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_truncated_clamp_and_temperature_match_oracle(grad_in_forward) -> None:
    hidden, weight, bias, ids, logprobs, mask = _problem(seed=2)
    # Small teacher mass and a flat student on some rows: there q_i > p_i, the truncated
    # loss goes negative and is clamped (about half of the rows).
    logprobs = logprobs - 4.0
    hidden = hidden.clone()
    hidden[:, :20] *= 0.05
    options = {"mode": "truncated", "reduction": "sum", "temperature": 1.6, "clamp_min": 0.0}
    loss, stats, grads = _fused_grads(
        hidden, weight, bias, ids, logprobs, mask=mask, chunk_size=5,
        grad_in_forward=grad_in_forward, **options,
    )  # fmt: skip
    want, want_grads = _oracle_grads(hidden, weight, bias, ids, logprobs, mask=mask, **options)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    assert 0.0 < stats.clamped_fraction < 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_low_precision_inputs_match_oracle(dtype, mode) -> None:
    hidden, weight, bias, ids, logprobs, mask = _problem(seed=3, dtype=dtype)
    loss, _, grads = _fused_grads(
        hidden, weight, bias, ids, logprobs, mask=mask, mode=mode, chunk_size=16
    )
    assert all(g is not None and g.dtype == dtype for g in grads)
    # Oracle on the same (rounded) inputs, in float64.
    want, want_grads = _oracle_grads(
        hidden, weight, bias, ids, logprobs, mask=mask, mode=mode, reduction="mean"
    )
    if dtype == torch.float32:
        rtol, atol = 1e-5, 1e-6
    else:  # bf16 logits block and bf16 matmuls: a few bf16 ulps, relative to the scale
        rtol, atol = 3e-2, 1e-2
    torch.testing.assert_close(loss.double(), want, rtol=rtol, atol=atol)
    for got, expected in zip(grads, want_grads, strict=True):
        scale = float(expected.abs().max())
        torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_equals_topk_kl_loss_on_the_same_logits(reduction) -> None:
    hidden, weight, bias, ids, logprobs, mask = _problem(seed=4, dtype=torch.float32)
    options = {"mode": "tail", "reduction": reduction, "mask": mask, "overlap": True}
    loss, stats, grads = _fused_grads(hidden, weight, bias, ids, logprobs, chunk_size=9, **options)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    want, want_stats = topk_kl_loss(
        leaves[0] @ leaves[1].T + leaves[2], *teacher_and_options(ids, logprobs, **options)
    )
    want.sum().backward()
    torch.testing.assert_close(loss, want.detach(), rtol=2e-6, atol=1e-7)
    for got, leaf in zip(grads, leaves, strict=True):
        assert leaf.grad is not None
        scale = float(leaf.grad.abs().max())  # fp32 rounding, relative to the gradient's scale
        torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-5 * scale)
    for name, value in stats.as_dict().items():
        assert value == pytest.approx(want_stats.as_dict()[name], rel=1e-5, abs=1e-7), name


def test_overlap_is_nan_unless_asked_and_matches_oracle_when_asked() -> None:
    hidden, weight, bias, ids, logprobs, _ = _problem(seed=5)
    _, stats = lm_head_topk_kl_loss((weight, bias), hidden, TeacherTargets(ids, logprobs))
    assert math.isnan(stats.overlap)
    _, stats = lm_head_topk_kl_loss(
        (weight, bias), hidden, TeacherTargets(ids, logprobs), LossOptions(overlap=True)
    )
    rows = oracle_rows(hidden @ weight.T + bias, ids, logprobs, mode="tail")
    assert stats.overlap == pytest.approx(float(rows["overlap"].mean()), rel=1e-12)


def test_no_bias_no_grad_and_partial_requires_grad() -> None:
    hidden, weight, _, ids, logprobs, _ = _problem(seed=6)
    with torch.no_grad():
        loss, _ = lm_head_topk_kl_loss(weight, hidden, TeacherTargets(ids, logprobs))
    assert not loss.requires_grad
    # Only the weight trains (e.g. a frozen trunk): hidden gets no gradient.
    leaf = weight.clone().requires_grad_(True)
    loss, _ = lm_head_topk_kl_loss(
        leaf, hidden, TeacherTargets(ids, logprobs), LossOptions(chunk_size=10)
    )
    loss.backward()
    reference = weight.clone().requires_grad_(True)
    oracle_loss(hidden @ reference.T, ids, logprobs, mode="tail").backward()
    torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-9, atol=1e-12)


def test_upstream_gradient_scales_precomputed_gradients() -> None:
    hidden, weight, _, ids, logprobs, _ = _problem(seed=7)
    leaf = hidden.clone().requires_grad_(True)
    loss, _ = lm_head_topk_kl_loss(
        weight, leaf, TeacherTargets(ids, logprobs), LossOptions(reduction="sum")
    )
    (3.5 * loss).backward()
    reference = hidden.clone().requires_grad_(True)
    (
        3.5 * oracle_loss(reference @ weight.T, ids, logprobs, mode="tail", reduction="sum")
    ).backward()
    torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-9, atol=1e-12)


def test_second_backward_through_precomputed_gradients_is_refused() -> None:
    hidden, weight, _, ids, logprobs, _ = _problem(seed=8)
    leaf = hidden.clone().requires_grad_(True)
    loss, _ = lm_head_topk_kl_loss(weight, leaf, TeacherTargets(ids, logprobs))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_empty_batch_and_nothing_counted() -> None:
    hidden, weight, _, ids, logprobs, mask = _problem(seed=9)
    leaf = hidden[:0].clone().requires_grad_(True)
    loss, stats = lm_head_topk_kl_loss(weight, leaf, TeacherTargets(ids[:0], logprobs[:0]))
    loss.backward()
    assert float(loss.detach()) == 0.0 and stats.positions == 0
    leaf = hidden.clone().requires_grad_(True)
    loss, stats = lm_head_topk_kl_loss(
        weight, leaf, TeacherTargets(ids, logprobs, mask=torch.zeros_like(mask))
    )
    loss.backward()
    assert float(loss.detach()) == 0.0 and stats.positions == 0
    assert leaf.grad is not None and bool((leaf.grad == 0).all())


@pytest.mark.parametrize(
    ("change", "argument", "message"),
    [
        (lambda p: {**p, "weight": p["weight"][:, :5]}, "weight", "H = 37"),
        (lambda p: {**p, "weight": p["weight"][0]}, "weight", r"\[V_local, H\]"),
        (lambda p: {**p, "weight": p["weight"].float()}, "weight", "dtype"),
        (lambda p: {**p, "bias": p["bias"][:5]}, "bias", "shape"),
        (lambda p: {**p, "bias": p["bias"].float()}, "bias", "dtype"),
        (lambda p: {**p, "hidden": p["hidden"].long()}, "hidden", "dtype"),
        (lambda p: {**p, "ids": p["ids"][:2]}, "teacher\\.ids", "leading dims of hidden"),
        (lambda p: {**p, "ids": p["ids"] + VOCAB}, "teacher\\.ids", r"\[0, 123\)"),
    ],
)
def test_invalid_inputs_name_the_argument(change, argument, message) -> None:
    hidden, weight, bias, ids, logprobs, _ = _problem(seed=10)
    values = change(
        {"hidden": hidden, "weight": weight, "bias": bias, "ids": ids, "logprobs": logprobs}
    )
    with pytest.raises(ValueError, match=rf"^{argument}:.*{message}"):
        lm_head_topk_kl_loss(
            (values["weight"], values["bias"]),
            values["hidden"],
            TeacherTargets(values["ids"], values["logprobs"]),
        )


def test_chunk_sizes_agree_with_each_other_in_float32() -> None:
    hidden, weight, bias, ids, logprobs, mask = _problem(seed=11, dtype=torch.float32)
    results = [
        _fused_grads(hidden, weight, bias, ids, logprobs, mask=mask, chunk_size=size)
        for size in (1, 7, 64, 500)
    ]
    for (loss, _, grads), (other_loss, _, other_grads) in itertools.pairwise(results):
        torch.testing.assert_close(loss, other_loss, rtol=1e-6, atol=1e-7)
        for got, expected in zip(grads, other_grads, strict=True):
            scale = float(expected.abs().max())
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)
