"""Input checks of `topk_kl_loss`: every problem is a ValueError naming the argument."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from student_client.losses.masking import counted_rows
from student_client.losses.types import LOSS_MODES, REDUCTIONS, SUPPORTS

if TYPE_CHECKING:
    from student_client.losses.teacher import TeacherTargets

__all__ = [
    "LOGIT_DTYPES",
    "LOGPROB_TOLERANCE",
    "CountedRows",
    "check_candidate_values",
    "check_candidates",
    "check_counted_values",
    "check_linear",
    "check_local_tensor",
    "check_mask_values",
    "check_options",
    "check_sample_values",
    "check_sampled",
    "check_sampled_values",
    "check_teacher",
    "check_teacher_values",
    "check_tensors",
    "dtensor_type",
]

LOGPROB_TOLERANCE = 1e-3
"""Teacher log-probs above this are rejected (a little above 0 is rounding)."""

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _fail(argument: str, problem: str) -> ValueError:
    return ValueError(f"{argument}: {problem}")


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_options(
    *,
    mode: str,
    reduction: str,
    chunk_size: int | None,
    temperature: float,
    tail_mass_eps: float,
    clamp_min: float | None,
    truncatable: bool = True,
    divergence_name: str = "forward",
    support: str = "teacher",
    overlap: bool = False,
) -> None:
    """Check the non-tensor options of the losses (`LossOptions`)."""
    if mode not in LOSS_MODES:
        raise _fail("mode", f"must be one of {LOSS_MODES}, got {mode!r}")
    if support not in SUPPORTS:
        raise _fail("support", f"must be one of {SUPPORTS}, got {support!r}")
    if overlap and support == "student":
        raise _fail(
            "overlap",
            "needs the teacher's top-k among the support ('teacher' or 'union'), "
            "not support 'student'",
        )
    if mode == "truncated" and not truncatable:
        raise _fail(
            "mode",
            f"'truncated' applies to the forward KL only, not to divergence {divergence_name!r}",
        )
    if reduction not in REDUCTIONS:
        raise _fail("reduction", f"must be one of {REDUCTIONS}, got {reduction!r}")
    if chunk_size is not None and (
        not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
    ):
        raise _fail("chunk_size", f"must be None or an int >= 1, got {chunk_size!r}")
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature <= 0:
        raise _fail("temperature", f"must be a finite number > 0, got {temperature!r}")
    if not _is_real(tail_mass_eps) or not 0.0 < tail_mass_eps < 1.0:
        raise _fail("tail_mass_eps", f"must lie strictly between 0 and 1, got {tail_mass_eps!r}")
    if clamp_min is not None:
        if mode != "truncated":
            raise _fail("clamp_min", f"applies to mode 'truncated' only, not {mode!r}")
        if not _is_real(clamp_min) or math.isnan(clamp_min):
            raise _fail("clamp_min", f"must be None or a number, got {clamp_min!r}")


def check_tensors(
    logits: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor | None,
    *,
    global_vocab: int,
    student_name: str = "logits",
    last_dim: str = "V_local",
    ids_name: str = "teacher.ids",
    values_name: str = "teacher.logprobs",
) -> None:
    """Check types, dtypes, devices and shapes (no value checks: nothing syncs).

    Expected: `logits` `[..., V_local]` (for the fused loss: `hidden` `[..., H]`, named by
    `student_name` / `last_dim`), `teacher_ids` and `teacher_logprobs` `[..., K]` with
    `1 <= K <= global_vocab`, `mask` `[...]` or None. `ids_name` / `values_name` name the
    two teacher tensors in messages.
    """
    for name, value in (
        (student_name, logits),
        (ids_name, teacher_ids),
        (values_name, teacher_logprobs),
    ):
        if not isinstance(value, Tensor):
            raise _fail(name, f"must be a torch.Tensor, got {type(value).__name__}")
        check_local_tensor(name, value)
    if logits.dtype not in LOGIT_DTYPES:
        raise _fail(student_name, f"dtype must be one of {LOGIT_DTYPES}, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise _fail(
            student_name,
            f"must have shape [..., {last_dim}] with {last_dim} >= 1, got {_shape(logits)}",
        )
    if teacher_ids.dtype.is_floating_point or teacher_ids.dtype.is_complex:
        raise _fail(ids_name, f"must be an integer tensor, got {teacher_ids.dtype}")
    if teacher_ids.dtype == torch.bool:
        raise _fail(ids_name, "must be an integer tensor, got torch.bool")
    if not teacher_logprobs.dtype.is_floating_point:
        raise _fail(values_name, f"must be a float tensor, got {teacher_logprobs.dtype}")
    positions = logits.shape[:-1]
    if teacher_ids.dim() != logits.dim() or teacher_ids.shape[:-1] != positions:
        raise _fail(
            ids_name,
            f"shape {_shape(teacher_ids)} must be [..., K] with [...] = {_shape(logits)[:-1]} "
            f"(the leading dims of {student_name})",
        )
    top_k = teacher_ids.shape[-1]
    if not 1 <= top_k <= global_vocab:
        raise _fail(ids_name, f"K = {top_k} must lie in [1, vocab size {global_vocab}]")
    if teacher_logprobs.shape != teacher_ids.shape:
        raise _fail(
            values_name,
            f"shape {_shape(teacher_logprobs)} must equal {ids_name}' {_shape(teacher_ids)}",
        )
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise _fail("mask", f"must be None or a torch.Tensor, got {type(mask).__name__}")
        if mask.shape != positions:
            raise _fail("mask", f"shape {_shape(mask)} must equal {_shape(logits)[:-1]}")
    others: dict[str, Tensor | None] = {
        ids_name: teacher_ids,
        values_name: teacher_logprobs,
        "mask": mask,
    }
    for name, other in others.items():
        if other is not None and other.device != logits.device:
            raise _fail(name, f"is on {other.device}, {student_name} on {logits.device}")


class CountedRows(NamedTuple):
    """A checked top-k teacher value's rows, flat: what the support's columns are built
    from (`support.support_columns`). On the student's device; log-probs detached."""

    counted: Tensor  # bool [N]: the positions that count (masking.counted_positions)
    ids: Tensor  # [N, K], placeholders where a position does not count
    logprobs: Tensor  # [N, K], -inf where a position does not count
    candidates: tuple[Tensor, Tensor] | None  # [N, C] ids and log-probs (supports with candidates)
    actual: tuple[Tensor, Tensor] | None  # [N, 1] the actual token's (mode "tail_actual")


def check_teacher(
    student: Tensor,
    teacher: TeacherTargets,
    *,
    mode: str,
    support: str,
    validate: bool,
    global_vocab: int,
    names: dict[str, str],
) -> CountedRows:
    """Check a top-k teacher value against the student, all in this one call: types,
    dtypes, devices and shapes (no sync), then the rows that count
    (`masking.counted_rows`), then, with `validate`, the values a loss reads at those rows
    only (`check_counted_values`, a few host syncs).

    Args:
        student: `[..., V_local]` logits or `[..., H]` hidden states (named by `names`,
            `check_tensors`' keywords `student_name` / `last_dim`).
        teacher: its `ids` / `logprobs` `[..., K]`, `mask` `[...]`; mode "tail_actual"'s
            `sampled_ids` / `sampled_logprobs` `[...]`; supports "student" / "union"'s
            `candidate_ids` / `candidate_logprobs` `[..., C]`.
        mode, support, validate: as in `LossOptions`.
        global_vocab: the whole vocabulary's size (all shards).
    """
    check_tensors(
        student, teacher.ids, teacher.logprobs, teacher.mask, global_vocab=global_vocab, **names
    )
    positions, device = student.shape[:-1], student.device
    check_sampled(mode, teacher.sampled_ids, teacher.sampled_logprobs, positions, device)
    check_candidates(support, teacher.candidate_ids, teacher.candidate_logprobs, positions, device)
    n_positions = student[..., 0].numel() if student.dim() else 0
    top_k = teacher.ids.shape[-1]
    logprobs = teacher.logprobs.detach().reshape(n_positions, top_k)
    counted, ids, logprobs = counted_rows(
        teacher.ids.reshape(n_positions, top_k), logprobs, teacher.mask, device
    )
    candidates = None
    if support != "teacher":
        assert teacher.candidate_ids is not None and teacher.candidate_logprobs is not None
        pair = (teacher.candidate_ids, teacher.candidate_logprobs)
        candidates = _flat(pair, n_positions, teacher.candidate_ids.shape[-1], device)
    actual = None
    if mode == "tail_actual":
        assert teacher.sampled_ids is not None and teacher.sampled_logprobs is not None
        actual = _flat((teacher.sampled_ids, teacher.sampled_logprobs), n_positions, 1, device)
    if validate:  # the counted rows as given (the placeholders are elsewhere)
        check_counted_values(
            teacher.mask,
            counted,
            (ids, logprobs),
            candidates=candidates,
            actual=actual,
            global_vocab=global_vocab,
        )
    return CountedRows(counted, ids, logprobs, candidates, actual)


def _flat(
    pair: tuple[Tensor, Tensor], n_rows: int, width: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """`(ids, logprobs)` `[..., width]` (or `[...]` for width 1) -> `[N, width]` on
    `device`; the log-probs detached."""
    ids, logprobs = pair
    return (
        ids.reshape(n_rows, width).to(device=device),
        logprobs.detach().reshape(n_rows, width).to(device=device),
    )


def check_linear(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """Check the fused loss's lm_head: `weight` `[V_local, H]`, `bias` `[V_local]` or None.

    `hidden` `[..., H]` is checked by `check_tensors`; here: its dtype, and that the weight
    matches it.
    """
    if hidden.dtype not in LOGIT_DTYPES:
        raise _fail("hidden", f"dtype must be one of {LOGIT_DTYPES}, got {hidden.dtype}")
    if not isinstance(weight, Tensor):
        raise _fail("weight", f"must be a torch.Tensor, got {type(weight).__name__}")
    for name, value in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if value is not None:
            check_local_tensor(name, value)
    if weight.dim() != 2 or weight.shape[0] < 1:
        raise _fail(
            "weight", f"must have shape [V_local, H] with V_local >= 1, got {_shape(weight)}"
        )
    hidden_size = hidden.shape[-1] if hidden.dim() else None
    if weight.shape[1] != hidden_size:
        raise _fail(
            "weight",
            f"shape {_shape(weight)} must be [V_local, H] with H = {hidden_size} "
            f"(the last dim of hidden)",
        )
    if weight.dtype != hidden.dtype:
        raise _fail("weight", f"dtype {weight.dtype} must equal hidden's {hidden.dtype}")
    if weight.device != hidden.device:
        raise _fail("weight", f"is on {weight.device}, hidden on {hidden.device}")
    if bias is None:
        return
    if not isinstance(bias, Tensor):
        raise _fail("bias", f"must be None or a torch.Tensor, got {type(bias).__name__}")
    if bias.shape != weight.shape[:1]:
        raise _fail("bias", f"shape {_shape(bias)} must be [V_local] = [{weight.shape[0]}]")
    if bias.dtype != weight.dtype or bias.device != weight.device:
        raise _fail(
            "bias",
            f"must match weight's dtype and device ({weight.dtype} on {weight.device}), "
            f"got {bias.dtype} on {bias.device}",
        )


def _check_aligned(
    name: str, value: object, shape: torch.Size, device: torch.device, needed_by: str, dims: str
) -> Tensor:
    """`value` must be a tensor of `shape` on `device` (the student's); `needed_by` and
    `dims` name what asks for it and its expected shape, for the message."""
    if not isinstance(value, Tensor):
        raise _fail(name, f"{needed_by} needs a torch.Tensor {dims}, got {type(value).__name__}")
    if value.shape != shape:
        raise _fail(name, f"shape {_shape(value)} must equal {list(shape)} {dims}")
    if value.device != device:
        raise _fail(name, f"is on {value.device}, the student on {device}")
    return value


def _check_int(name: str, value: Tensor) -> None:
    dtype = value.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise _fail(name, f"must be an integer tensor, got {dtype}")


def _check_float(name: str, value: Tensor) -> None:
    if not value.dtype.is_floating_point:
        raise _fail(name, f"must be a float tensor, got {value.dtype}")


def check_sampled(
    mode: str,
    sampled_ids: Tensor | None,
    sampled_logprobs: Tensor | None,
    positions: torch.Size,
    device: torch.device,
) -> None:
    """Mode "tail_actual" needs `sampled_ids` (int) and `sampled_logprobs` (float), both
    `[...]` (the positions' shape) on the student's device; other modes do not use them
    (a teacher value carries what its payload holds; the options choose what counts)."""
    given = {"sampled_ids": sampled_ids, "sampled_logprobs": sampled_logprobs}
    if mode != "tail_actual":
        return
    for name, value in given.items():
        _check_aligned(name, value, positions, device, "mode 'tail_actual'", "(the positions)")
    assert sampled_ids is not None and sampled_logprobs is not None  # checked just above
    _check_int("sampled_ids", sampled_ids)
    _check_float("sampled_logprobs", sampled_logprobs)


def check_candidates(
    support: str,
    candidate_ids: Tensor | None,
    candidate_logprobs: Tensor | None,
    positions: torch.Size,
    device: torch.device,
) -> None:
    """Supports "student" and "union" need `candidate_ids` (int) and `candidate_logprobs`
    (float), both `[..., C]` (`[...]` the positions' shape) on the student's device;
    support "teacher" does not use them."""
    given = {"candidate_ids": candidate_ids, "candidate_logprobs": candidate_logprobs}
    if support == "teacher":
        return
    if not isinstance(candidate_ids, Tensor):
        raise _fail(
            "candidate_ids",
            f"support {support!r} needs a torch.Tensor [..., C], got "
            f"{type(candidate_ids).__name__}",
        )
    width = candidate_ids.shape[-1] if candidate_ids.dim() else 0
    shape = torch.Size([*positions, width])
    dims = f"([..., C] with [...] = the positions {list(positions)})"
    for name, value in given.items():
        _check_aligned(name, value, shape, device, f"support {support!r}", dims)
    assert candidate_logprobs is not None  # checked just above
    _check_int("candidate_ids", candidate_ids)
    _check_float("candidate_logprobs", candidate_logprobs)


def check_counted_values(
    mask: Tensor | None,
    counted: Tensor,
    teacher: tuple[Tensor, Tensor],
    *,
    candidates: tuple[Tensor, Tensor] | None,
    actual: tuple[Tensor, Tensor] | None,
    global_vocab: int,
) -> None:
    """Every value a loss reads, once: the `mask`'s, and at the counted positions
    (`counted` bool `[N]`) the teacher's top-k `[N, K]`, the candidates `[N, C]` and the
    actual token `[N, 1]` (each `(ids, logprobs)`; None: not used). Host syncs: the caller
    skips this under `validate=False`."""
    check_mask_values(mask)
    check_teacher_values(teacher[0][counted], teacher[1][counted], global_vocab)
    if candidates is not None:
        check_candidate_values(candidates[0][counted], candidates[1][counted], global_vocab)
    if actual is not None:
        check_sampled_values(actual[0][counted], actual[1][counted], global_vocab)


def check_candidate_values(
    candidate_ids: Tensor, candidate_logprobs: Tensor, global_vocab: int
) -> None:
    """The counted rows' candidates `[n, C]`: ids in `[0, global_vocab)` or -1 (padding);
    at every id that is not -1 a log-prob `<= 0` (up to `LOGPROB_TOLERANCE`), not NaN
    (`-inf` allowed). Repeated ids are allowed (counted once)."""
    if candidate_ids.numel() == 0:
        return
    _check_id_range("candidate_ids", candidate_ids, global_vocab, padding=True)
    named = candidate_logprobs[candidate_ids != -1]
    if bool(named.isnan().any()):
        raise _fail("candidate_logprobs", "NaN at a candidate id that is not -1 (padding)")
    _check_at_most_zero("candidate_logprobs", named)


def check_sampled_values(sampled_ids: Tensor, sampled_logprobs: Tensor, global_vocab: int) -> None:
    """The counted rows' actual tokens: ids in `[0, global_vocab)`, log-probs `<= 0` (up to
    `LOGPROB_TOLERANCE`) or NaN (no next token: that row has no actual-token category)."""
    if sampled_ids.numel() == 0:
        return
    _check_id_range("sampled_ids", sampled_ids, global_vocab)
    known = sampled_logprobs[~sampled_logprobs.isnan()]
    _check_at_most_zero("sampled_logprobs", known, " or NaN")


def _check_id_range(name: str, ids: Tensor, global_vocab: int, *, padding: bool = False) -> None:
    """Non-empty `ids` must lie in `[0, global_vocab)`, or be -1 with `padding` (two host
    syncs)."""
    low, high = int(ids.min()), int(ids.max())
    if low < (-1 if padding else 0) or high >= global_vocab:
        allowed = " or be -1 (padding)" if padding else ""
        raise _fail(
            name,
            f"ids must lie in [0, {global_vocab}) (the vocabulary){allowed}, "
            f"got values in [{low}, {high}]",
        )


def check_sample_values(sample_ids: Tensor, sample_weights: Tensor, global_vocab: int) -> None:
    """The counted rows of a sampled teacher: counts finite and `>= 0`; the ids of the
    columns with count > 0 in `[0, global_vocab)` and distinct within a row (a column of
    count 0 is padding and may hold anything)."""
    if sample_ids.numel() == 0:
        return
    if not bool(sample_weights.isfinite().all()) or bool((sample_weights < 0).any()):
        raise _fail("teacher.sample_counts", "must be finite and >= 0")
    drawn = sample_weights > 0
    if bool(drawn.any()):
        _check_id_range("teacher.ids", sample_ids[drawn], global_vocab)
    # padding columns get distinct negative stand-ins, so only drawn ids can collide
    column = torch.arange(sample_ids.shape[-1], device=sample_ids.device)
    ordered = torch.where(drawn, sample_ids.to(torch.int64), -1 - column).sort(dim=-1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise _fail("teacher.ids", "a drawn id (count > 0) repeats within a position")


def _check_at_most_zero(name: str, logprobs: Tensor, also: str = "") -> None:
    """`logprobs` (NaN-free) must be `<= LOGPROB_TOLERANCE` (one host sync; none if empty);
    `also` names what else the argument may hold, for the message."""
    if logprobs.numel() == 0:
        return
    largest = float(logprobs.max())
    if largest > LOGPROB_TOLERANCE:
        raise _fail(
            name,
            f"log-probs must be <= 0 (tolerance {LOGPROB_TOLERANCE}){also}, got {largest:.6g}",
        )


def check_mask_values(mask: Tensor | None) -> None:
    """A non-bool `mask` must hold only 0 and 1 (one host sync)."""
    if mask is not None and mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise _fail("mask", "must be bool or hold only 0 and 1")


def check_teacher_values(teacher_ids: Tensor, teacher_logprobs: Tensor, global_vocab: int) -> None:
    """Check the teacher rows of the positions that count.

    Args:
        teacher_ids: `[n, K]` global ids: must lie in `[0, global_vocab)` and be distinct
            within a row (a vLLM payload never repeats an id; a repeated id would count
            its student log-prob twice, so it is rejected rather than silently used).
        teacher_logprobs: `[n, K]`: no NaN, none above `LOGPROB_TOLERANCE`; `-inf` is allowed.
        global_vocab: vocabulary size over all shards.
    """
    if teacher_ids.numel() == 0:
        return
    _check_id_range("teacher.ids", teacher_ids, global_vocab)
    ordered = teacher_ids.sort(dim=-1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise _fail(
            "teacher.ids",
            "an id repeats within a position; ids must be distinct (the padding rows of a "
            "ragged or padded batch's payload hold ids 0: the teacher value needs its mask)",
        )
    if bool(teacher_logprobs.isnan().any()):
        raise _fail("teacher.logprobs", "contains NaN")
    _check_at_most_zero("teacher.logprobs", teacher_logprobs)


def _shape(tensor: Tensor) -> list[int]:
    """Shape as a plain list, for messages."""
    return list(tensor.shape)


def dtensor_type() -> type | None:
    """`torch.distributed.tensor.DTensor`, or None on a torch without it."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


_LOCAL_FIX = {
    "logits": "pass logits.to_local() with process_group=<the TP group> (a ColwiseParallel "
    "lm_head returns local logits with its default use_local_output=True)",
    "weight": "tensor parallel: pass weight.to_local() with process_group=<the TP group>; "
    "FSDP2: fully_shard(lm_head) the head module itself and call "
    "lm_head_topk_kl_loss(lm_head, hidden, ...), which runs the loss inside its unshard",
}
_LOCAL_FIX["bias"] = _LOCAL_FIX["weight"].replace("weight.to_local()", "bias.to_local()")


def check_local_tensor(name: str, value: Tensor) -> None:
    """Refuse a DTensor: the losses take local tensors and a `process_group`, and a DTensor's
    shape is the global one, so using it as local would compute against the wrong shard
    (docs/scaling.md).

    Only looked up if `torch.distributed.tensor` is already imported (no DTensor can exist
    before): importing it just to check would add about 26 MiB of modules to the process.
    """
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None or not isinstance(value, dtensor):
        return
    sharded: Any = value  # a DTensor (mypy cannot narrow to a runtime type)
    fix = _LOCAL_FIX.get(name, f"pass a plain tensor (the full {name}: {name}.full_tensor())")
    raise _fail(
        name,
        f"is a DTensor (placements {tuple(sharded.placements)} on a mesh of shape "
        f"{tuple(sharded.device_mesh.shape)}); the losses take local tensors: {fix} "
        f"(docs/scaling.md)",
    )
