"""The support choice (teacher top-k, student candidates, their union) for every divergence.

The dense float64 reference (`losses/reference.py`) is first checked against the test
oracle (`coarse_oracle.py`, which lists each row's categories in plain Python), then the
chunked loss and the fused lm_head loss are checked against it in loss, per-position loss,
stats and gradients: 3 x 47 positions, V = 123, K = 7, C = 9 candidates with padded rows,
repeats of top-k ids and of each other (`support_cases.py`), a mask whose rows hold
garbage candidates, temperature != 1, bf16; mode "tail_actual" on every support; a
support that is the whole vocabulary gives the full divergence; validation errors.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from coarse_oracle import DIVERGENCE_CASES, dense_divergence, reference_rows
from support_cases import SUPPORTS, make_candidates

from student_client.losses import (
    LossOptions,
    TeacherTargets,
    TopKKLLoss,
    get_divergence,
    lm_head_topk_kl_loss,
    topk_kl_loss,
    topk_kl_reference,
)
from tests.student_client.losses.calls import teacher_and_options

LEAD, V, H, K, C = (3, 47), 123, 37, 7, 9
N = LEAD[0] * LEAD[1]

DIVERGENCES = [pytest.param(name, params, id=name) for name, params in DIVERGENCE_CASES]
MODES_OF = {"forward": ("tail", "truncated", "tail_actual"), "reverse": ("tail", "tail_actual")}
MODE_CASES = [
    pytest.param(name, params, mode, id=f"{name}-{mode}")
    for name, params in DIVERGENCE_CASES
    for mode in MODES_OF.get(name, ("tail", "tail_actual"))
]


def _problem(seed: int) -> dict[str, torch.Tensor]:
    """Float64 logits `[3, 47, 123]`, a teacher top-7, 9 candidates per position, actual
    tokens (NaN at each sequence's last), a mask with rows 7..20 and 30 out; `garbage`:
    the candidates with out-of-range ids and repeats in the masked rows."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=generator, dtype=torch.float64) * 2.5
    teacher = torch.log_softmax(
        torch.randn(N, V, generator=generator, dtype=torch.float64) * 2.5, -1
    )
    logprobs, ids = teacher.topk(K, dim=-1)
    candidate_ids, candidate_logprobs = make_candidates(logits, ids, teacher, C, seed=seed)
    sampled = torch.multinomial(teacher.exp(), 1, generator=generator)[:, 0]
    sampled[::5] = candidate_ids[::5, 2].clamp_min(0)  # some inside the candidates
    sampled_lp = teacher.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    sampled_lp[LEAD[1] - 1 :: LEAD[1]] = math.nan
    mask = torch.ones(N, dtype=torch.bool)
    mask[7:21] = False
    mask[30] = False
    garbage = candidate_ids.clone()
    garbage[~mask] = torch.tensor([V + 5, -7, 3, 3, 0, 0, 1, 2, V])[:C]
    return {
        "logits": logits.reshape(*LEAD, V),
        "teacher_full": teacher.reshape(*LEAD, V),
        "ids": ids.reshape(*LEAD, K),
        "logprobs": logprobs.reshape(*LEAD, K),
        "candidate_ids": candidate_ids.reshape(*LEAD, C),
        "candidate_logprobs": candidate_logprobs.reshape(*LEAD, C),
        "garbage_ids": garbage.reshape(*LEAD, C),
        "sampled_ids": sampled.reshape(LEAD),
        "sampled_logprobs": sampled_lp.reshape(LEAD),
        "mask": mask.reshape(LEAD),
    }


def _extra(problem: dict[str, torch.Tensor], support: str, mode: str, *, clean: bool = False):
    """The loss's candidate / actual-token arguments for `support` and `mode` (`clean`:
    the candidates without the masked rows' garbage, for the reference)."""
    extra: dict[str, Any] = {}
    if support != "teacher":
        extra["candidate_ids"] = problem["candidate_ids" if clean else "garbage_ids"]
        extra["candidate_logprobs"] = problem["candidate_logprobs"]
    if mode == "tail_actual":
        extra["sampled_ids"] = problem["sampled_ids"]
        extra["sampled_logprobs"] = problem["sampled_logprobs"]
    return extra


def _reference(logits64, problem, name, params, support, mode, temperature):
    """The reference's `RowTerms` `[3, 47]` (`loss` with its graph to `logits64`)."""
    return topk_kl_reference(
        logits64,
        *teacher_and_options(
            problem["ids"],
            problem["logprobs"],
            mode=mode,
            temperature=temperature,
            divergence=get_divergence(name, **params),
            support=support,
            **_extra(problem, support, mode, clean=True),
        ),
    )


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weight = mask.double()
    return (values * weight).sum() / weight.sum()


def test_the_problem_has_every_kind_of_candidate() -> None:
    problem = _problem(0)
    ids = problem["candidate_ids"].reshape(N, C)
    top = problem["ids"].reshape(N, K)
    assert bool((ids == -1).all(-1).any()) and bool(
        ((ids == -1).any(-1) & (ids >= 0).any(-1)).any()
    )
    in_top = (ids.unsqueeze(-1) == top.unsqueeze(-2)).any(-1) & (ids >= 0)
    assert 0 < int(in_top.sum()) < int((ids >= 0).sum())
    repeats = (ids.unsqueeze(-1) == ids.unsqueeze(-2)).sum(-1) > 1
    assert bool((repeats & (ids >= 0)).any())
    sampled = problem["sampled_ids"].reshape(N, 1)
    assert bool((ids == sampled).any(-1).any())


@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize(("name", "params", "mode"), MODE_CASES)
def test_the_reference_matches_the_oracle(name, params, mode, support) -> None:
    """The library's dense reference against the test's own oracle: loss and gradient."""
    problem = _problem(1)
    leaf = problem["logits"].clone().requires_grad_(True)
    rows = _reference(leaf, problem, name, params, support, mode, 1.3)
    rows.loss.sum().backward()
    oracle_leaf = problem["logits"].reshape(N, V).clone().requires_grad_(True)
    extra = {
        key: value.reshape(N, -1) if key.startswith("candidate") else value.reshape(N)
        for key, value in _extra(problem, support, mode, clean=True).items()
    }
    want = reference_rows(
        oracle_leaf,
        problem["ids"].reshape(N, K),
        problem["logprobs"].reshape(N, K),
        divergence=name,
        params=params,
        mode=mode,
        temperature=1.3,
        support=support,
        **extra,
    )
    want.sum().backward()
    torch.testing.assert_close(rows.loss.reshape(N), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(leaf.grad.reshape(N, V), oracle_leaf.grad, rtol=1e-8, atol=1e-12)


def _check_logits_path(problem, logits, options, name, params, support, *, loss_rtol, grad_rtol):
    """`topk_kl_loss` on `logits` (any dtype) against the reference on the same values:
    the masked mean, its gradient, the per-position loss and the stats."""
    mode, temperature = options.mode, options.temperature
    want_leaf = logits.detach().double().requires_grad_(True)
    want_rows = _reference(want_leaf, problem, name, params, support, mode, temperature)
    want = _masked_mean(want_rows.loss, problem["mask"])
    want.backward()
    leaf = logits.detach().clone().requires_grad_(True)
    extra = _extra(problem, support, mode)
    loss, stats = topk_kl_loss(
        leaf,
        *teacher_and_options(
            problem["ids"], problem["logprobs"], mask=problem["mask"], options=options, **extra
        ),
    )
    loss.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=loss_rtol, atol=1e-7)
    torch.testing.assert_close(leaf.grad.double(), want_leaf.grad, rtol=grad_rtol, atol=2e-8)
    per_position, _ = topk_kl_loss(
        logits.detach(),
        *teacher_and_options(
            problem["ids"],
            problem["logprobs"],
            mask=problem["mask"],
            options=options,
            reduction="none",
            **extra,
        ),
    )
    kept = problem["mask"]
    torch.testing.assert_close(
        per_position[kept].double(), want_rows.loss[kept].detach(), rtol=loss_rtol, atol=1e-7
    )
    assert bool((per_position[~kept] == 0).all())
    for stat, field in (
        ("head_loss", "head"),
        ("tail_loss", "tail"),
        ("teacher_mass", "teacher_mass"),
        ("student_mass", "student_mass"),
    ):
        expected = float(_masked_mean(getattr(want_rows, field), kept))
        assert getattr(stats, stat) == pytest.approx(expected, rel=loss_rtol, abs=1e-7), stat
    assert stats.positions == int(kept.sum())


@pytest.mark.parametrize("temperature", [1.0, 1.6])
@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize(("name", "params"), DIVERGENCES)
def test_logits_path_matches_the_reference(name, params, support, temperature) -> None:
    problem = _problem(2)
    for chunk_size in (7, 1000):
        options = LossOptions(
            divergence=get_divergence(name, **params),
            support=support,
            chunk_size=chunk_size,
            temperature=temperature,
        )
        _check_logits_path(
            problem, problem["logits"].float(), options, name, params, support,
            loss_rtol=2e-6, grad_rtol=1e-4,
        )  # fmt: skip


@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize(("name", "params", "mode"), MODE_CASES)
def test_every_mode_on_every_support(name, params, mode, support) -> None:
    """ "truncated" (the support's terms alone) and "tail_actual" (the actual token apart
    where it is outside the support) compose with each support."""
    problem = _problem(3)
    options = LossOptions(
        divergence=get_divergence(name, **params),
        support=support,
        mode=mode,
        chunk_size=5,
        temperature=0.8,
        overlap=support != "student",
    )
    _check_logits_path(
        problem, problem["logits"].float(), options, name, params, support,
        loss_rtol=2e-6, grad_rtol=1e-4,
    )  # fmt: skip


@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize(("name", "params"), DIVERGENCES)
def test_logits_path_bf16(name, params, support) -> None:
    """bf16 logits: against the reference on the bf16-rounded values."""
    problem = _problem(4)
    options = LossOptions(
        divergence=get_divergence(name, **params), support=support, chunk_size=7, temperature=1.3
    )
    _check_logits_path(
        problem, problem["logits"].bfloat16(), options, name, params, support,
        loss_rtol=1e-5, grad_rtol=1e-2,
    )  # fmt: skip


def _linear(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*LEAD, H, generator=generator, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=generator, dtype=torch.float64) * 0.4).to(dtype)
    bias = torch.randn(V, generator=generator, dtype=torch.float64).to(dtype)
    return hidden, weight, bias


@pytest.mark.parametrize(
    ("dtype", "chunk_size", "temperature", "grad_in_forward", "mode"),
    [
        (torch.float32, 7, 1.6, True, "tail"),
        (torch.float32, 1000, 1.0, False, "tail_actual"),
        (torch.bfloat16, 7, 1.3, True, "tail"),
    ],
)
@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize(("name", "params"), DIVERGENCES)
def test_fused_path_matches_the_reference(
    name, params, support, dtype, chunk_size, temperature, grad_in_forward, mode
) -> None:
    problem = _problem(5)
    hidden, weight, bias = _linear(6, dtype)
    leaves64 = [t.detach().double().requires_grad_(True) for t in (hidden, weight, bias)]
    logits64 = leaves64[0] @ leaves64[1].T + leaves64[2]
    if dtype == torch.bfloat16:  # the fused loss rounds its logits block to bf16 once
        logits64 = logits64 + (logits64.to(dtype).double() - logits64).detach()
    rows = _reference(logits64, problem, name, params, support, mode, temperature)
    want = _masked_mean(rows.loss, problem["mask"])
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
            support=support,
            mode=mode,
            chunk_size=chunk_size,
            temperature=temperature,
            grad_in_forward=grad_in_forward,
            **_extra(problem, support, mode),
        ),
    )
    loss.backward()
    if dtype == torch.float32:
        rtol, grad_rtol, grad_atol = 1e-5, 1e-4, 1e-6
    else:  # the gradient block is rounded to bf16 before its matmuls
        rtol, grad_rtol, grad_atol = 1e-5, 3e-2, 1e-2
    torch.testing.assert_close(loss.double(), want.detach(), rtol=rtol, atol=rtol * 1e-2)
    for leaf, reference, label in zip(leaves, leaves64, ("hidden", "weight", "bias"), strict=True):
        scale = float(reference.grad.abs().max())
        torch.testing.assert_close(
            leaf.grad.double(), reference.grad, rtol=grad_rtol, atol=grad_atol * scale, msg=label
        )
    assert stats.positions == int(problem["mask"].sum())


@pytest.mark.parametrize("support", ["student", "union"])
@pytest.mark.parametrize(("name", "params"), DIVERGENCES)
def test_whole_vocabulary_support_is_the_full_divergence(name, params, support) -> None:
    """Candidates that name every id (in a random order, with repeats and padding): the
    coarse-grained divergence is the full one, loss and gradient."""
    generator = torch.Generator().manual_seed(7)
    rows, vocab, top_k = 6, 31, 4
    log_q = torch.log_softmax(
        torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * 2, -1
    )
    log_p = torch.log_softmax(
        torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * 2, -1
    )
    logprobs, ids = log_p.topk(top_k, dim=-1)
    every = torch.stack([torch.randperm(vocab, generator=generator) for _ in range(rows)])
    candidates = torch.cat([every, every[:, :3], torch.full((rows, 2), -1)], dim=-1)
    candidate_logprobs = torch.where(
        candidates >= 0, log_p.gather(1, candidates.clamp_min(0)), math.nan
    )
    leaf = log_q.clone().requires_grad_(True)
    coarse, _ = topk_kl_loss(
        leaf,
        TeacherTargets(
            ids, logprobs, candidate_ids=candidates, candidate_logprobs=candidate_logprobs
        ),
        LossOptions(
            divergence=get_divergence(name, **params),
            support=support,
            reduction="none",
            tail_mass_eps=1e-12,
        ),
    )
    coarse.sum().backward()
    full_leaf = log_q.clone().requires_grad_(True)
    full = dense_divergence(name, params, log_p, torch.log_softmax(full_leaf, -1))
    full.sum().backward()
    torch.testing.assert_close(coarse, full.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(leaf.grad, full_leaf.grad, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize(("name", "params"), DIVERGENCES)
def test_candidates_that_add_nothing_give_the_teacher_support(name, params) -> None:
    """Union with candidates that are all top-k ids or padding, and the student support
    with candidates equal to the top-k (shuffled, repeated), both equal the teacher's."""
    problem = _problem(8)
    logits = problem["logits"].float()
    ids, logprobs = problem["ids"], problem["logprobs"]
    options = LossOptions(divergence=get_divergence(name, **params), reduction="none")
    want, _ = topk_kl_loss(logits, TeacherTargets(ids, logprobs), options)
    order = torch.tensor([3, 0, 6, 5, 1, 2, 4, 0, 3])
    shuffled_ids = ids[..., order]
    shuffled_logprobs = logprobs[..., order]
    padded = torch.cat([shuffled_ids[..., :4], torch.full((*LEAD, 2), -1)], dim=-1)
    padded_logprobs = torch.cat([shuffled_logprobs[..., :4], torch.full((*LEAD, 2), math.nan)], -1)
    for support, candidates, candidate_logprobs in (
        ("union", padded, padded_logprobs),
        ("student", shuffled_ids, shuffled_logprobs),
    ):
        got, _ = topk_kl_loss(
            logits,
            TeacherTargets(
                ids, logprobs, candidate_ids=candidates, candidate_logprobs=candidate_logprobs
            ),
            dataclasses.replace(options, support=support),
        )
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=support)


def test_errors_name_the_argument_and_the_limit() -> None:
    logits, ids, logprobs = (
        torch.zeros(2, 3, 5),
        torch.zeros(2, 3, 1, dtype=torch.long),
        torch.full((2, 3, 1), -1.0),
    )
    candidates = torch.tensor([[[0, 1], [2, -1], [4, 4]]] * 2)
    candidate_logprobs = torch.where(candidates >= 0, -1.0, math.nan)
    good = {"candidate_ids": candidates, "candidate_logprobs": candidate_logprobs}

    def call(**kwargs: Any) -> None:
        topk_kl_loss(
            logits, *teacher_and_options(ids, logprobs, **{"support": "union", **good, **kwargs})
        )

    call()
    with pytest.raises(
        ValueError, match=r"^support: must be one of \('teacher', 'student', 'union'\)"
    ):
        LossOptions(support="both")
    with pytest.raises(ValueError, match=r"^overlap: needs the teacher's top-k among the support"):
        LossOptions(support="student", overlap=True)
    with pytest.raises(
        ValueError, match=r"^candidate_ids: support 'student' needs a torch.Tensor \[\.\.\., C\]"
    ):
        topk_kl_loss(logits, TeacherTargets(ids, logprobs), LossOptions(support="student"))
    # support "teacher" ignores the candidates a teacher value carries
    with_candidates = topk_kl_loss(logits, *teacher_and_options(ids, logprobs, **good))[0]
    assert torch.equal(with_candidates, topk_kl_loss(logits, TeacherTargets(ids, logprobs))[0])
    with pytest.raises(ValueError, match=r"^candidate_ids: shape \[2, 3\] must equal \[2, 3, 3\]"):
        call(candidate_ids=candidates[..., 0])
    with pytest.raises(
        ValueError, match=r"^candidate_logprobs: shape \[2, 3, 1\] must equal \[2, 3, 2\]"
    ):
        call(candidate_logprobs=candidate_logprobs[..., :1])
    with pytest.raises(
        ValueError,
        match=r"^candidate_ids: shape \[2, 2, 2\] must equal \[2, 3, 2\] "
        r"\(\[\.\.\., C\] with \[\.\.\.\] = the positions \[2, 3\]\)",
    ):
        call(candidate_ids=candidates[:, :2], candidate_logprobs=candidate_logprobs[:, :2])
    with pytest.raises(
        ValueError, match=r"^candidate_ids: must be an integer tensor, got torch.float32"
    ):
        call(candidate_ids=candidates.float())
    with pytest.raises(
        ValueError, match=r"^candidate_logprobs: must be a float tensor, got torch.int64"
    ):
        call(candidate_logprobs=candidates)
    with pytest.raises(
        ValueError,
        match=r"^candidate_ids: ids must lie in \[0, 5\) \(the vocabulary\) or be -1 "
        r"\(padding\), got values in \[-1, 5\]",
    ):
        call(candidate_ids=torch.where(candidates == 4, 5, candidates))
    with pytest.raises(
        ValueError, match=r"^candidate_ids: ids must lie in \[0, 5\).*got values in \[-2, 4\]"
    ):
        call(candidate_ids=torch.where(candidates == -1, -2, candidates))
    with pytest.raises(
        ValueError, match=r"^candidate_logprobs: NaN at a candidate id that is not -1"
    ):
        call(candidate_logprobs=torch.full_like(candidate_logprobs, math.nan))
    with pytest.raises(
        ValueError,
        match=r"^candidate_logprobs: log-probs must be <= 0 \(tolerance 0.001\), got 0.5",
    ):
        call(candidate_logprobs=torch.where(candidates >= 0, 0.5, math.nan))
    # Rows that do not count are not validated (padding may hold anything).
    mask = torch.tensor([[True, True, False]] * 2)
    call(candidate_ids=torch.where(candidates == 4, 99, candidates), mask=mask)


def test_the_module_takes_candidates() -> None:
    problem = _problem(9)
    extra = _extra(problem, "union", "tail")
    teacher = TeacherTargets(problem["ids"], problem["logprobs"], mask=problem["mask"], **extra)
    options = LossOptions(support="union", divergence="jsd")
    want, _ = topk_kl_loss(problem["logits"], teacher, options)
    got, _ = TopKKLLoss(options)(problem["logits"], teacher)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_no_candidates_and_no_positions() -> None:
    """`C = 0`: the union is the teacher's support, the student's support only the tail
    (loss 0); an empty batch gives 0."""
    problem = _problem(10)
    logits = problem["logits"].float()
    teacher = TeacherTargets(
        problem["ids"],
        problem["logprobs"],
        candidate_ids=torch.zeros(*LEAD, 0, dtype=torch.long),
        candidate_logprobs=torch.zeros(*LEAD, 0),
    )
    reverse = LossOptions(divergence="reverse", reduction="none")
    want, _ = topk_kl_loss(logits, teacher, reverse)
    union, _ = topk_kl_loss(logits, teacher, dataclasses.replace(reverse, support="union"))
    torch.testing.assert_close(union, want, rtol=1e-6, atol=1e-7)
    options = LossOptions(divergence="reverse", support="student")
    student, stats = topk_kl_loss(logits, teacher, options)
    assert float(student) == 0.0 and stats.teacher_mass == 0.0
    empty, _ = topk_kl_loss(
        torch.zeros(0, V),
        TeacherTargets(
            torch.zeros(0, K, dtype=torch.long),
            torch.zeros(0, K),
            candidate_ids=torch.zeros(0, C, dtype=torch.long),
            candidate_logprobs=torch.zeros(0, C),
        ),
        LossOptions(support="union"),
    )
    assert float(empty) == 0.0
