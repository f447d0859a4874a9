"""Every divergence x mode against the float64 coarse-grained oracle (`coarse_oracle.py`):
loss and gradients of `topk_kl_loss` (logits) and `lm_head_topk_kl_loss` (hidden, weight,
bias) at odd shapes, chunk sizes 1 / 7 / more than N, a mask with whole chunks masked out,
temperature != 1, bf16, a +1e4 offset of the logits; the data-processing inequality
(coarse <= full, equal at K = V) as a property; no host sync with `validate=False`."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from coarse_oracle import DIVERGENCE_CASES, MODES_OF, dense_divergence, reference_rows
from host_sync import NoHostSync
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from test_no_host_sync import _problem as nosync_problem

from student_client.losses import (
    LossOptions,
    TeacherTargets,
    get_divergence,
    lm_head_topk_kl_loss,
    topk_kl_loss,
)
from tests.student_client.losses.calls import teacher_and_options

LEAD, V, H, K = (3, 47), 123, 37, 7
N = LEAD[0] * LEAD[1]

CASES = [
    pytest.param(name, params, mode, id=f"{name}-{mode}")
    for name, params in DIVERGENCE_CASES
    for mode in MODES_OF[name]
]


def _problem(seed: int, *, offset: float = 0.0) -> dict[str, torch.Tensor]:
    """Logits `[3, 47, 123]` (float64), a teacher top-7, actual tokens (a third inside the
    top-k, NaN on every 47th row: a sequence's last), a mask with rows 7..20 out."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(*LEAD, V, generator=generator, dtype=torch.float64) * 2.5 + offset
    teacher = torch.log_softmax(
        torch.randn(*LEAD, V, generator=generator, dtype=torch.float64) * 2.5, -1
    )
    logprobs, ids = teacher.topk(K, dim=-1)
    sampled = torch.multinomial(teacher.exp().reshape(N, V), 1, generator=generator).reshape(LEAD)
    sampled_lp = teacher.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    sampled_lp[:, -1] = math.nan
    mask = torch.ones(LEAD, dtype=torch.bool).reshape(N)
    mask[7:21] = False  # whole chunks of 7 rows
    mask[30] = False
    return {
        "logits": logits,
        "ids": ids,
        "logprobs": logprobs,
        "sampled_ids": sampled,
        "sampled_logprobs": sampled_lp,
        "mask": mask.reshape(LEAD),
    }


def _actual(problem: dict[str, torch.Tensor], mode: str) -> dict[str, Any]:
    if mode != "tail_actual":
        return {}
    return {"sampled_ids": problem["sampled_ids"], "sampled_logprobs": problem["sampled_logprobs"]}


def _reference_mean(
    logits64: torch.Tensor, problem: dict[str, torch.Tensor], name, params, mode, temperature
):
    """Masked mean of the oracle's per-position loss, float64, graph to `logits64`."""
    actual = _actual(problem, mode)
    rows = reference_rows(
        logits64.reshape(N, V),
        problem["ids"].reshape(N, K),
        problem["logprobs"].reshape(N, K),
        divergence=name,
        params=params,
        mode=mode,
        temperature=temperature,
        **{key: value.reshape(N) for key, value in actual.items()},
    )
    weight = problem["mask"].reshape(N).double()
    return (rows * weight).sum() / weight.sum(), rows


def test_the_problem_covers_both_kinds_of_actual_token() -> None:
    problem = _problem(0)
    inside = (problem["ids"] == problem["sampled_ids"].unsqueeze(-1)).any(-1)
    assert 0 < int(inside.sum()) < N


@pytest.mark.parametrize("temperature", [1.0, 1.6])
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
@pytest.mark.parametrize(("name", "params", "mode"), CASES)
def test_logits_path_matches_the_oracle(name, params, mode, chunk_size, temperature) -> None:
    problem = _problem(1)
    want_leaf = problem["logits"].clone().requires_grad_(True)
    want, want_rows = _reference_mean(want_leaf, problem, name, params, mode, temperature)
    want.backward()
    logits = problem["logits"].float().requires_grad_(True)
    options = LossOptions(
        divergence=get_divergence(name, **params),
        mode=mode,
        chunk_size=chunk_size,
        temperature=temperature,
    )
    loss, stats = topk_kl_loss(
        logits,
        *teacher_and_options(
            problem["ids"],
            problem["logprobs"],
            mask=problem["mask"],
            options=options,
            **_actual(problem, mode),
        ),
    )
    loss.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(logits.grad.double(), want_leaf.grad, rtol=1e-4, atol=2e-8)
    assert stats.loss == pytest.approx(float(want.detach()), rel=2e-6)
    per_position, _ = topk_kl_loss(
        logits.detach(),
        *teacher_and_options(
            problem["ids"],
            problem["logprobs"],
            mask=problem["mask"],
            options=options,
            reduction="none",
            **_actual(problem, mode),
        ),
    )
    kept = problem["mask"]
    torch.testing.assert_close(
        per_position[kept].double(), want_rows.reshape(LEAD)[kept].detach(), rtol=2e-6, atol=1e-7
    )
    assert bool((per_position[~kept] == 0).all())


@pytest.mark.parametrize(("name", "params", "mode"), CASES)
def test_logits_path_bf16_and_offset(name, params, mode) -> None:
    problem = _problem(2)
    options = LossOptions(
        divergence=get_divergence(name, **params), mode=mode, chunk_size=7, temperature=0.8
    )
    # bf16: against the oracle on the bf16-rounded logits; the gradient is rounded once.
    _check_against_oracle(problem["logits"].bfloat16(), problem, options, name, params, 1e-2)
    # A +1e4 offset: fp32 logits near 1e4 (rounded there); centred on the row max exactly.
    _check_against_oracle((problem["logits"] + 1e4).float(), problem, options, name, params, 1e-4)


def _check_against_oracle(
    logits: torch.Tensor, problem, options: LossOptions, name, params, grad_rtol: float
) -> None:
    """Loss and logits gradient vs the oracle on the same (rounded) logits."""
    leaf = logits.clone().requires_grad_(True)
    want_leaf = logits.double().requires_grad_(True)
    want, _ = _reference_mean(want_leaf, problem, name, params, options.mode, options.temperature)
    want.backward()
    loss, _ = topk_kl_loss(
        leaf,
        *teacher_and_options(
            problem["ids"],
            problem["logprobs"],
            mask=problem["mask"],
            options=options,
            **_actual(problem, options.mode),
        ),
    )
    loss.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(leaf.grad.double(), want_leaf.grad, rtol=grad_rtol, atol=2e-8)


def _linear(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*LEAD, H, generator=generator, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=generator, dtype=torch.float64) * 0.4).to(dtype)
    bias = torch.randn(V, generator=generator, dtype=torch.float64).to(dtype)
    return hidden, weight, bias


@pytest.mark.parametrize("grad_in_forward", [True, False])
@pytest.mark.parametrize(
    ("dtype", "chunk_size", "temperature"),
    [
        (torch.float32, 1, 1.0),
        (torch.float32, 7, 1.6),
        (torch.float32, 1000, 0.7),
        (torch.bfloat16, 7, 1.3),
    ],
)
@pytest.mark.parametrize(("name", "params", "mode"), CASES)
def test_fused_path_matches_the_oracle(
    name, params, mode, dtype, chunk_size, temperature, grad_in_forward
) -> None:
    problem = _problem(3)
    hidden, weight, bias = _linear(4, dtype)
    leaves64 = [t.detach().double().requires_grad_(True) for t in (hidden, weight, bias)]
    logits64 = leaves64[0] @ leaves64[1].T + leaves64[2]
    want, _ = _reference_mean(logits64, problem, name, params, mode, temperature)
    want.backward()
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    loss, stats = lm_head_topk_kl_loss(
        (leaves[1], leaves[2]),
        leaves[0],
        *teacher_and_options(
            problem["ids"],
            problem["logprobs"],
            mask=problem["mask"],
            divergence=get_divergence(name, **params),
            mode=mode,
            chunk_size=chunk_size,
            temperature=temperature,
            grad_in_forward=grad_in_forward,
            **_actual(problem, mode),
        ),
    )
    loss.backward()
    if dtype == torch.float32:
        rtol, grad_rtol, grad_atol = 1e-5, 1e-4, 1e-6
    else:
        # The bf16 logits block is rounded by up to 0.05 here (|z| ~ 10). The forward KL's
        # gradient moves by ~0.6% of its largest entry, the reverse KL's, which holds
        # q (log q̂ - log p̂ - D), by ~2% (the logits path on bf16 logits: the same).
        rtol, grad_rtol, grad_atol = 1e-4, 3e-2, 3e-2
    torch.testing.assert_close(loss.double(), want.detach(), rtol=rtol, atol=rtol * 1e-2)
    for leaf, reference, label in zip(leaves, leaves64, ("hidden", "weight", "bias"), strict=True):
        scale = float(reference.grad.abs().max())
        torch.testing.assert_close(
            leaf.grad.double(), reference.grad, rtol=grad_rtol, atol=grad_atol * scale, msg=label
        )
    assert stats.positions == int(problem["mask"].sum())


@pytest.mark.parametrize(("name", "params", "mode"), CASES)
def test_fused_equals_the_logits_path(name, params, mode) -> None:
    """Same logits both ways (fp32): loss, stats and gradients agree to fp32 rounding."""
    problem = _problem(5)
    hidden, weight, bias = _linear(6, torch.float32)
    options = LossOptions(
        divergence=get_divergence(name, **params), mode=mode, chunk_size=5, overlap=True
    )
    fused_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    fused, fused_stats = lm_head_topk_kl_loss(
        (fused_leaves[1], fused_leaves[2]),
        fused_leaves[0],
        *teacher_and_options(
            problem["ids"],
            problem["logprobs"],
            mask=problem["mask"],
            options=options,
            **_actual(problem, mode),
        ),
    )
    fused.backward()
    plain_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    logits = plain_leaves[0] @ plain_leaves[1].T + plain_leaves[2]
    plain, plain_stats = topk_kl_loss(
        logits,
        *teacher_and_options(
            problem["ids"],
            problem["logprobs"],
            mask=problem["mask"],
            options=options,
            **_actual(problem, mode),
        ),
    )
    plain.backward()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    for name_, value in fused_stats.as_dict().items():
        assert value == pytest.approx(plain_stats.as_dict()[name_], rel=1e-5, abs=1e-6), name_
    for a, b in zip(fused_leaves, plain_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


@settings(max_examples=examples(60), deadline=None)
@given(
    vocab=st.integers(2, 30),
    k_fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
    scale=st.floats(0.1, 6.0),
    case=st.sampled_from(range(len(DIVERGENCE_CASES))),
    actual=st.booleans(),
)
# K = V - 1 merges nothing: coarse == full in exact arithmetic, and float64 rounding of
# values near 16 once exceeded an absolute 1e-9.
@example(vocab=4, k_fraction=0.75, seed=2147483646, scale=4.0, case=1, actual=False)
def test_coarse_divergence_is_at_most_the_full_one(
    vocab, k_fraction, seed, scale, case, actual
) -> None:
    """Data-processing inequality: merging categories never increases the divergence; at
    K = V (nothing merged) the coarse divergence is the full one."""
    name, params = DIVERGENCE_CASES[case]
    top_k = max(1, round(k_fraction * vocab))
    generator = torch.Generator().manual_seed(seed)
    log_q = torch.log_softmax(
        torch.randn(4, vocab, generator=generator, dtype=torch.float64) * scale, -1
    )
    log_p = torch.log_softmax(
        torch.randn(4, vocab, generator=generator, dtype=torch.float64) * scale, -1
    )
    logprobs, ids = log_p.topk(top_k, dim=-1)
    mode = "tail_actual" if actual else "tail"
    extra: dict[str, Any] = {}
    if actual:
        sampled = torch.randint(0, vocab, (4,), generator=generator)
        extra = {
            "sampled_ids": sampled,
            "sampled_logprobs": log_p.gather(-1, sampled[:, None])[:, 0],
        }
    coarse, _ = topk_kl_loss(
        log_q,
        *teacher_and_options(
            ids,
            logprobs,
            divergence=get_divergence(name, **params),
            mode=mode,
            reduction="none",
            tail_mass_eps=1e-12,
            **extra,
        ),
    )
    full = dense_divergence(name, params, log_p, log_q)
    # float64 rounding grows with the values compared: the slack is relative.
    assert bool((coarse <= full + 1e-9 * full.abs().clamp_min(1.0)).all()), (coarse, full)
    assert bool((coarse >= -1e-12 * full.abs().clamp_min(1.0)).all())
    if top_k == vocab:
        torch.testing.assert_close(coarse, full, rtol=1e-9, atol=1e-9)


def _nosync_problem(seed: int):
    """`test_no_host_sync`'s problem plus actual tokens (the last position has none)."""
    hidden, weight, ids, logprobs, mask = nosync_problem(seed)
    generator = torch.Generator().manual_seed(seed)
    sampled = torch.randint(0, weight.shape[0], mask.shape, generator=generator)
    sampled_lp = torch.log(torch.rand(mask.shape, generator=generator) * 0.1)
    sampled_lp[:, -1] = math.nan
    return (
        hidden,
        weight,
        ids,
        logprobs,
        mask,
        {"sampled_ids": sampled, "sampled_logprobs": sampled_lp},
    )


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize(("name", "params", "mode"), CASES)
def test_no_host_sync(name, params, mode, fused) -> None:
    hidden, weight, ids, logprobs, mask, actual = _nosync_problem(7)
    if mode != "tail_actual":
        actual = {}
    options = LossOptions(
        divergence=get_divergence(name, **params), mode=mode, validate=False, chunk_size=5
    )
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    guard = NoHostSync()
    with guard:
        if fused:
            loss, stats = lm_head_topk_kl_loss(
                weight,
                hidden,
                *teacher_and_options(ids, logprobs, mask=mask, options=options, **actual),
            )
        else:
            loss, stats = topk_kl_loss(
                hidden @ weight.T,
                *teacher_and_options(ids, logprobs, mask=mask, options=options, **actual),
            )
        loss.backward()
    assert guard.ops > 0
    checked = LossOptions(divergence=options.divergence, mode=mode, chunk_size=5)
    want, want_stats = topk_kl_loss(
        (hidden @ weight.T).detach(),
        *teacher_and_options(ids, logprobs, mask=mask, options=checked, **actual),
    )
    torch.testing.assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    assert stats.positions == want_stats.positions
    assert hidden.grad is not None and bool(hidden.grad.abs().sum() > 0)


def test_option_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"^mode: 'truncated' applies to the forward KL only"):
        LossOptions(divergence="reverse", mode="truncated")
    with pytest.raises(ValueError, match=r"^divergence: must be one of"):
        LossOptions(divergence="hellinger")
    with pytest.raises(ValueError, match=r"^divergence: 'reverse' does not take \['beta'\]"):
        get_divergence("reverse", beta=0.5)
    with pytest.raises(TypeError, match="reductio"):
        LossOptions(reductio="sum")  # type: ignore[call-arg]  # no field of that name
    with pytest.raises(ValueError, match=r"^options: must be a LossOptions, got dict"):
        topk_kl_loss(
            torch.zeros(2, 5),
            TeacherTargets(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1)),
            {"reduction": "sum"},  # type: ignore[arg-type]
        )
    logits, ids, logprobs = torch.zeros(2, 5), torch.tensor([[0], [1]]), torch.full((2, 1), -1.0)
    with pytest.raises(ValueError, match=r"^sampled_ids: mode 'tail_actual' needs a torch.Tensor"):
        topk_kl_loss(logits, TeacherTargets(ids, logprobs), LossOptions(mode="tail_actual"))
    # fields the options do not use are ignored (a teacher value carries what it holds)
    unused = TeacherTargets(ids, logprobs, sampled_ids=torch.zeros(2, dtype=torch.long))
    assert torch.equal(
        topk_kl_loss(logits, unused)[0], topk_kl_loss(logits, TeacherTargets(ids, logprobs))[0]
    )
    with pytest.raises(ValueError, match=r"^sampled_logprobs: shape \[3\] must equal"):
        topk_kl_loss(
            logits,
            TeacherTargets(
                ids,
                logprobs,
                sampled_ids=torch.zeros(2, dtype=torch.long),
                sampled_logprobs=torch.zeros(3),
            ),
            LossOptions(mode="tail_actual"),
        )
    with pytest.raises(ValueError, match=r"^sampled_ids: ids must lie in \[0, 5\)"):
        topk_kl_loss(
            logits,
            TeacherTargets(
                ids, logprobs, sampled_ids=torch.tensor([0, 5]), sampled_logprobs=torch.zeros(2)
            ),
            LossOptions(mode="tail_actual"),
        )
    with pytest.raises(ValueError, match=r"^sampled_logprobs: log-probs must be <= 0"):
        topk_kl_loss(
            logits,
            TeacherTargets(
                ids,
                logprobs,
                sampled_ids=torch.tensor([0, 4]),
                sampled_logprobs=torch.tensor([0.5, math.nan]),
            ),
            LossOptions(mode="tail_actual"),
        )
