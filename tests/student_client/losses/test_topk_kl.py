"""`topk_kl_loss` / `TopKKLLoss`: validation, masks, reductions, clamping, stats."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest
import torch
from losses_oracle import make_case, oracle_loss, oracle_rows

import student_client.losses as losses_package
from student_client.losses import (
    LossOptions,
    TeacherTargets,
    TopKKLLoss,
    TopKKLStats,
    topk_kl_loss,
)
from student_client.losses.types import STAT_FIELDS, LossMode, Reduction
from tests.student_client.losses.calls import teacher_and_options

MODES: tuple[LossMode, ...] = ("tail", "truncated")


@pytest.fixture
def case():
    return make_case((4, 5), 33, 4, seed=21)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"mode": "forward_kl"}, "mode"),
        ({"reduction": "avg"}, "reduction"),
        ({"tail_mass_eps": 0.0}, "tail_mass_eps"),
        ({"tail_mass_eps": 1.0}, "tail_mass_eps"),
        ({"tail_mass_eps": -1e-6}, "tail_mass_eps"),
        ({"clamp_min": 0.0}, "clamp_min"),  # default mode is "tail"
        ({"mode": "truncated", "clamp_min": math.nan}, "clamp_min"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 2.5}, "chunk_size"),
        ({"chunk_size": True}, "chunk_size"),
    ],
)
def test_invalid_options_name_the_argument(case, kwargs, argument) -> None:
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        topk_kl_loss(case.logits, *teacher_and_options(case.ids, case.logprobs, **kwargs))


def test_invalid_options_rejected_by_module_constructor() -> None:
    with pytest.raises(ValueError, match=r"^clamp_min:"):
        TopKKLLoss(LossOptions(mode="tail", clamp_min=0.0))
    with pytest.raises(ValueError, match=r"^mode:"):
        TopKKLLoss(LossOptions(mode="full"))  # type: ignore[arg-type]


def _with(case, **changes):
    values = {"logits": case.logits, "ids": case.ids, "logprobs": case.logprobs, "mask": None}
    values.update(changes)
    return values


@pytest.mark.parametrize(
    ("change", "argument", "message"),
    [
        (lambda c: _with(c, logits=c.logits.long()), "logits", "dtype"),
        (lambda c: _with(c, logits=torch.tensor(1.0)), "logits", "shape"),
        (lambda c: _with(c, logits=c.logits[..., :0]), "logits", "V_local >= 1"),
        (lambda c: _with(c, ids=c.ids.float()), "teacher\\.ids", "integer"),
        (lambda c: _with(c, ids=c.ids.bool()), "teacher\\.ids", "integer"),
        (lambda c: _with(c, ids=c.ids[:3]), "teacher\\.ids", "shape"),
        (
            lambda c: _with(c, ids=c.ids[..., :0], logprobs=c.logprobs[..., :0]),
            "teacher\\.ids",
            "K",
        ),
        (lambda c: _with(c, ids=c.ids.reshape(20, 4)), "teacher\\.ids", "shape"),
        (lambda c: _with(c, logprobs=c.logprobs[..., :3]), "teacher\\.logprobs", "shape"),
        (lambda c: _with(c, logprobs=c.ids), "teacher\\.logprobs", "float"),
        (lambda c: _with(c, mask=torch.ones(4, 4, dtype=torch.bool)), "mask", "shape"),
        (lambda c: _with(c, mask=torch.full((4, 5), 2)), "mask", "0 and 1"),
        (lambda c: _with(c, logits=[1.0]), "logits", "torch.Tensor"),
        (lambda c: _with(c, mask=[1.0]), "mask", "torch.Tensor"),
    ],
)
def test_invalid_tensors_name_the_argument(case, change, argument, message) -> None:
    values = change(case)
    with pytest.raises(ValueError, match=rf"^{argument}:.*{message}"):
        topk_kl_loss(
            values["logits"], TeacherTargets(values["ids"], values["logprobs"], mask=values["mask"])
        )


def test_k_larger_than_vocabulary_is_rejected() -> None:
    logits = torch.randn(2, 3)
    ids = torch.tensor([[0, 1, 2, 0], [0, 1, 2, 0]])
    with pytest.raises(ValueError, match=r"^teacher\.ids: K = 4"):
        topk_kl_loss(logits, TeacherTargets(ids, torch.full((2, 4), -1.0)))


@pytest.mark.parametrize("bad_id", [-1, 33, 10**6])
def test_ids_outside_vocabulary_are_rejected(case, bad_id: int) -> None:
    ids = case.ids.clone()
    ids[2, 3, 1] = bad_id
    with pytest.raises(ValueError, match=r"^teacher\.ids: ids must lie in \[0, 33\)"):
        topk_kl_loss(case.logits, TeacherTargets(ids, case.logprobs))


def test_duplicate_ids_are_rejected(case) -> None:
    ids = case.ids.clone()
    ids[1, 2, 3] = ids[1, 2, 0]
    with pytest.raises(ValueError, match=r"^teacher\.ids: an id repeats"):
        topk_kl_loss(case.logits, TeacherTargets(ids, case.logprobs))


@pytest.mark.parametrize(("value", "message"), [(math.nan, "NaN"), (0.01, "<= 0"), (5.0, "<= 0")])
def test_bad_teacher_logprobs_are_rejected(case, value: float, message: str) -> None:
    logprobs = case.logprobs.clone()
    logprobs[0, 1, 2] = value
    with pytest.raises(ValueError, match=rf"^teacher\.logprobs:.*{message}"):
        topk_kl_loss(case.logits, TeacherTargets(case.ids, logprobs))


def test_logprobs_slightly_above_zero_and_minus_inf_are_accepted() -> None:
    logits = torch.randn(3, 10)
    ids = torch.tensor([[0, 1, 2]] * 3)
    logprobs = torch.tensor([[5e-4, -math.inf, -math.inf]] * 3)
    for mode in MODES:
        loss, stats = topk_kl_loss(
            logits, TeacherTargets(ids, logprobs), LossOptions(mode=mode, reduction="none")
        )
        want = oracle_rows(logits, ids[:, :1], logprobs[:, :1], mode=mode)
        torch.testing.assert_close(loss.double(), want["loss"], rtol=1e-5, atol=1e-6)
        assert math.isfinite(stats.loss)


def test_uncounted_positions_are_not_validated(case) -> None:
    ids = case.ids.clone()
    logprobs = case.logprobs.clone()
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[3, 4] = False
    ids[3, 4] = 0  # padding: repeated (and here in-range) ids
    logprobs[3, 4] = 0.0
    ids[3, 4, 0] = -7
    logprobs[3, 4, 1] = math.nan
    loss, stats = topk_kl_loss(case.logits, TeacherTargets(ids, logprobs, mask=mask))
    want = oracle_loss(case.logits, case.ids, case.logprobs, mode="tail", mask=mask)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    assert stats.positions == 19


# ------------------------------------------------------------------ masks and reductions


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_masks_and_reductions_match_oracle(case, mode, reduction, mask_dtype) -> None:
    mask = torch.rand(4, 5, generator=torch.Generator().manual_seed(3)) > 0.4
    logits = case.logits.clone().requires_grad_(True)
    loss, _ = topk_kl_loss(
        logits,
        TeacherTargets(case.ids, case.logprobs, mask=mask.to(mask_dtype)),
        LossOptions(mode=mode, reduction=reduction, chunk_size=3),
    )
    reference = case.logits.double().requires_grad_(True)
    want = oracle_loss(
        reference, case.ids, case.logprobs, mode=mode, mask=mask, reduction=reduction
    )
    assert loss.shape == want.shape
    torch.testing.assert_close(loss.detach().double(), want.detach(), rtol=1e-5, atol=1e-6)
    loss.sum().backward()
    want.sum().backward()
    assert logits.grad is not None and reference.grad is not None
    torch.testing.assert_close(logits.grad.double(), reference.grad, rtol=1e-5, atol=1e-7)
    assert bool((logits.grad[~mask] == 0).all())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mask_with_no_counted_position_gives_zero(case, reduction: Reduction) -> None:
    logits = case.logits.clone().requires_grad_(True)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    loss, stats = topk_kl_loss(
        logits, TeacherTargets(case.ids, case.logprobs, mask=mask), LossOptions(reduction=reduction)
    )
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert logits.grad is not None
    assert bool((logits.grad == 0).all())
    assert stats == TopKKLStats(0.0, 0.0, 0.0, 0.0, 0.0, math.nan, 0.0, 0)  # overlap not asked


# ------------------------------------------------------------------ clamp_min (verl parity)


def test_clamp_min_matches_verl_clamp_and_reports_fraction() -> None:
    case = make_case((40,), 60, 6, seed=22, teacher_scale=0.5)
    logits = case.logits.clone()
    logits[:20].scatter_(1, case.ids[:20], 8.0)  # Q > P on half the rows: negative loss
    leaf = logits.clone().requires_grad_(True)
    loss, stats = topk_kl_loss(
        leaf,
        TeacherTargets(case.ids, case.logprobs),
        LossOptions(mode="truncated", clamp_min=0.0, reduction="sum"),
    )
    loss.backward()
    reference = logits.double().requires_grad_(True)
    raw = oracle_rows(reference, case.ids, case.logprobs, mode="truncated")["loss"]
    want = raw.clamp_min(0.0).sum()  # verl: per-token kl.clamp_min(0)
    want.backward()
    torch.testing.assert_close(loss.detach().double(), want.detach(), rtol=1e-5, atol=1e-6)
    assert leaf.grad is not None and reference.grad is not None
    torch.testing.assert_close(leaf.grad.double(), reference.grad, rtol=1e-5, atol=1e-7)
    negative = raw.detach() < 0
    assert stats.clamped_fraction == pytest.approx(float(negative.double().mean()))
    assert 0.0 < stats.clamped_fraction < 1.0
    assert bool((leaf.grad[negative] == 0).all())
    assert stats.loss == pytest.approx(float(want.detach()) / 40, rel=1e-5)


def test_truncated_without_clamp_keeps_negative_losses_and_their_gradient() -> None:
    case = make_case((10,), 60, 6, seed=23, teacher_scale=0.5)
    logits = case.logits.clone().scatter_(1, case.ids, 8.0).requires_grad_(True)
    loss, stats = topk_kl_loss(
        logits,
        TeacherTargets(case.ids, case.logprobs),
        LossOptions(mode="truncated", reduction="none"),
    )
    assert bool((loss < 0).all())
    assert stats.clamped_fraction == 0.0
    loss.sum().backward()
    assert logits.grad is not None
    assert bool((logits.grad.abs().sum(-1) > 0).all())


# ------------------------------------------------------------------ types and module


def test_integer_id_dtypes_and_logprob_dtypes(case) -> None:
    want, _ = topk_kl_loss(case.logits, TeacherTargets(case.ids, case.logprobs))
    for id_dtype in (torch.int32, torch.int64, torch.int16):
        for lp_dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            logprobs = case.logprobs.to(lp_dtype)
            loss, _ = topk_kl_loss(case.logits, TeacherTargets(case.ids.to(id_dtype), logprobs))
            exact, _ = topk_kl_loss(case.logits, TeacherTargets(case.ids, logprobs.double()))
            torch.testing.assert_close(loss, exact)
    torch.testing.assert_close(
        topk_kl_loss(case.logits, TeacherTargets(case.ids.int(), case.logprobs))[0],
        want,
        rtol=0,
        atol=0,
    )


def test_no_gradient_flows_to_teacher_logprobs(case) -> None:
    logprobs = case.logprobs.clone().requires_grad_(True)
    logits = case.logits.clone().requires_grad_(True)
    loss, _ = topk_kl_loss(logits, TeacherTargets(case.ids, logprobs))
    loss.backward()
    assert logprobs.grad is None
    assert logits.grad is not None


def test_module_wrapper_matches_function(case) -> None:
    module = TopKKLLoss(
        LossOptions(mode="truncated", reduction="sum", chunk_size=3, temperature=0.8, clamp_min=0.0)
    )
    assert "truncated" in repr(module)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[0] = False
    got, got_stats = module(case.logits, TeacherTargets(case.ids, case.logprobs, mask=mask))
    want, want_stats = topk_kl_loss(
        case.logits,
        TeacherTargets(case.ids, case.logprobs, mask=mask),
        LossOptions(
            mode="truncated", reduction="sum", chunk_size=3, temperature=0.8, clamp_min=0.0
        ),
    )
    assert torch.equal(got, want)
    assert got_stats == want_stats


def test_stats_are_plain_python_numbers(case) -> None:
    _, stats = topk_kl_loss(
        case.logits,
        TeacherTargets(case.ids, case.logprobs),
        LossOptions(mode="truncated", overlap=True),
    )
    values = stats.as_dict()
    assert set(values) == {*STAT_FIELDS, "positions"}
    assert all(type(value) is float for value in values.values())
    assert type(stats.positions) is int and stats.positions == 20
    assert type(stats.loss) is float
    assert 0.0 <= stats.overlap <= 1.0
    _, without_overlap = topk_kl_loss(
        case.logits, TeacherTargets(case.ids, case.logprobs), LossOptions(mode="truncated")
    )
    assert math.isnan(without_overlap.overlap)  # not computed unless asked for
    assert without_overlap.loss == stats.loss
    assert 0.0 < stats.teacher_mass <= 1.0 + 1e-6


def _module_stops(call: Callable[[], object], kernel: str) -> list[str]:
    """The losses' modules a call enters on its way into the module `kernel` (relative
    path), in order: one entry per call from one module of the package into another,
    recorded by a profile hook (no timing)."""
    root = Path(losses_package.__file__).parent

    def module_of(frame: FrameType | None) -> str | None:
        if frame is None or not frame.f_code.co_filename.startswith(str(root)):
            return None
        return str(Path(frame.f_code.co_filename).relative_to(root))

    stops: list[str] = []

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        if event != "call" or (stops and stops[-1] == kernel):
            return
        callee, caller = module_of(frame), module_of(frame.f_back)
        if callee is not None and caller is not None and callee != caller:
            stops.append(callee)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return stops


@pytest.mark.parametrize(
    "options",
    [
        None,
        LossOptions(mode="tail_actual", support="union", overlap=True),
        LossOptions(mode="truncated", clamp_min=0.0, reduction="none"),
    ],
    ids=["default", "tail_actual-union", "truncated-clamped"],
)
def test_options_reach_the_kernel_through_each_module_once(options: LossOptions | None) -> None:
    case = make_case((2, 3), 16, 4, seed=21)
    positions = case.ids.shape[:-1]
    teacher = TeacherTargets(
        case.ids,
        case.logprobs,
        sampled_ids=torch.zeros(positions, dtype=torch.int64),
        sampled_logprobs=torch.full(positions, -3.0),
        candidate_ids=torch.arange(3).repeat(*positions, 1),
        candidate_logprobs=torch.full((*positions, 3), -4.0),
    )
    stops = _module_stops(lambda: topk_kl_loss(case.logits, teacher, options), "kernels/chunked.py")
    assert stops[-1] == "kernels/chunked.py"
    assert "input_checks.py" in stops and "support.py" in stops
    assert len(stops) == len(set(stops)), f"a module entered twice on the way: {stops}"
