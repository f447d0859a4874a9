"""Fused lm_head + top-k KL: the student's `[N, V]` logits never exist.

`FusedLinearTopKKLFunction` walks row chunks of the last hidden states. Per chunk it computes
the chunk's logits `hidden[rows] @ weight.T (+ bias)` into one reused `[chunk, V_local]`
block (the weight's dtype), then runs the *same* per-chunk code as `topk_kl_loss`
(`chunked.reduce_chunk`, `terms_from_reductions`, `logit_gradient_`) on fp32 sub-blocks of
it, and multiplies the chunk's logit gradient into `grad_hidden` and `grad_weight` at once.

When the gradient is computed (docs/lm_head_loss.md; the measurements: docs/benchmarks.md):

- in forward (default for reduction "mean" / "sum"): three matmuls per chunk, like the
  logits path (logits, `G @ W`, `G.T @ h`). The upstream gradient of a reduced loss is one
  scalar, unknown in forward, so the gradients are computed for an upstream gradient of 1
  and backward multiplies them by it (in place). Only done when a gradient is needed.
- recomputed in backward (reduction "none", whose upstream gradient is per position, or
  `grad_in_forward=False`): forward keeps per-row statistics only; backward computes the
  chunk logits again (a fourth matmul) and rebuilds `exp(s - max)` from the saved row max.

Memory: one `[chunk, V_local]` block in the weight's dtype (six equal row chunks by
default, `sizing.fused_chunks`), one fp32 sub-block, `grad_weight` `[V_local, H]` in the
weight's dtype (summed with one rounding per row chunk; a compensated or fp32 sum on
request, `GradientSink`; a low-precision weight's teacher columns are summed in fp32 and
rounded once, `split_columns`), `grad_hidden` `[N, H]`, and `[N]` / `[N, K]` per-row
values. Nothing of size `[N, V]`.

Vocab-parallel: every rank holds a weight shard; the per-chunk collectives are those of
`reduce_chunk`; each rank's `G @ W_shard` is a partial sum of `grad_hidden`, all-reduced
(SUM) over the group once per call, so every rank returns the full `grad_hidden`. Each
rank's `grad_weight` / `grad_bias` are those of its own shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from student_client.losses.kernels.chunked import (
    TeacherColumns,
    chunk_bounds,
    clamp_rows,
    localized_columns,
    logit_gradient_,
    recompute_logit_gradient_,
    reduce_chunk,
    statistics_dtype,
    terms_from_reductions,
    working_dtype,
)
from student_client.losses.kernels.functional import GradientCoefficients, TeacherMass, teacher_mass
from student_client.losses.kernels.gradient_sink import GradientSink
from student_client.losses.kernels.settings import FusedSettings
from student_client.losses.masking import position_count, reduce_positions, reduction_gradient
from student_client.losses.types import KernelResult, RowTerms

__all__ = ["FusedLinearTopKKLFunction", "fused_topk_kl"]


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor) -> Tensor:
    """`out` `[n, V_local]` <- `hidden` `[n, H]` @ `weight.T` (+ `bias`), in the weight's dtype."""
    if bias is None:
        return torch.mm(hidden, weight.t(), out=out)
    return torch.addmm(bias, hidden, weight.t(), out=out)


def _row_scale(
    upstream: Tensor, clamped: Tensor, counted: Tensor, divisor: Tensor, settings: FusedSettings
) -> Tensor:
    """Upstream gradient of each row's unclamped loss (`masking.reduction_gradient`),
    divided by `T`, `[n]`."""
    scale = reduction_gradient(upstream, counted, clamped, divisor, settings.reduction)
    return scale * settings.loss.inv_temperature


@dataclass
class _ForwardResults:
    """Per-row outputs of the forward pass, `[N]` each (working dtype; `clamped` bool)."""

    columns: list[Tensor]
    clamped: Tensor
    saved: dict[str, Tensor]


def _buffers(n_rows: int, weight: Tensor, settings: FusedSettings) -> tuple[Tensor, Tensor | None]:
    """The reused `[chunk, V_local]` logits block (weight dtype) and fp32 sub-block (or None
    when the weight's dtype is the working dtype: the math then runs in the block itself)."""
    work_dtype = working_dtype(weight.dtype)
    chunk_rows = min(settings.chunk_rows, n_rows)
    block = weight.new_empty((chunk_rows, weight.shape[0]))
    if weight.dtype == work_dtype:
        return block, None
    sub_rows = min(settings.loss.chunk_rows, chunk_rows)
    return block, block.new_empty((sub_rows, weight.shape[0]), dtype=work_dtype)


def _saved_rows(n_rows: int, teacher: TeacherColumns, factory: dict[str, Any]) -> dict[str, Tensor]:
    """What backward needs of each row, filled chunk by chunk: `[N]` row max, total,
    coefficients, and the teacher's probabilities `[N, K']`."""
    saved = {name: torch.empty(n_rows, **factory) for name in _SAVED[:-1]}
    saved["teacher_probs"] = torch.empty(teacher.index.shape, **factory)
    return saved


#: The rows' values backward reads; the last one `[N, K']`, the others `[N]`.
_SAVED = ("row_max", "total", "outside", "inside_extra", "teacher_probs")


def _forward_chunks(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    teacher: TeacherColumns,
    counted: Tensor,
    settings: FusedSettings,
    sink: GradientSink | None,
    keep_for_backward: bool,
) -> _ForwardResults:
    """The chunk loop of forward: loss terms per row, and the gradients when `sink` is given.

    Buffers live only inside this function, so they are freed before the gradients are
    rounded (`sink.finish`).
    """
    n_rows = hidden.shape[0]
    work_dtype = working_dtype(weight.dtype)
    factory: dict[str, Any] = {"dtype": work_dtype, "device": hidden.device}
    columns = [torch.empty(n_rows, **factory) for _ in range(6)]
    clamped = torch.zeros(n_rows, dtype=torch.bool, device=hidden.device)
    saved = _saved_rows(n_rows, teacher, factory) if keep_for_backward else {}
    masses = teacher_mass(teacher.logprobs)  # once: it depends on the teacher only
    unit = torch.ones((), **factory)
    divisor = position_count(counted)

    block_buffer, work_buffer = _buffers(n_rows, weight, settings)
    for rows in chunk_bounds(n_rows, settings.chunk_rows):
        block = _chunk_logits(hidden[rows], weight, bias, block_buffer[: rows.stop - rows.start])
        for sub in chunk_bounds(block.shape[0], settings.loss.chunk_rows):
            part = slice(rows.start + sub.start, rows.start + sub.stop)
            logits = block[sub]
            work = logits if work_buffer is None else work_buffer[: logits.shape[0]]
            chunk_teacher = teacher.rows(part)
            chunk_pass = reduce_chunk(logits, work, chunk_teacher, settings.loss)
            terms, coefficients, teacher_probs = terms_from_reductions(
                chunk_teacher.logprobs,
                chunk_pass.reductions,
                settings.loss,
                TeacherMass(*(value[part] for value in masses)),
                present=chunk_teacher.present,
            )
            loss, clamped[part] = clamp_rows(terms.loss, settings.loss.clamp_min)
            values = (loss, *terms[1:])
            for column, value in zip(columns, values, strict=True):
                column[part] = value
            reduced = chunk_pass.reductions
            total = reduced.sum_outside + reduced.sum_inside
            coefficients_w = GradientCoefficients(
                outside=coefficients.outside.to(work_dtype),
                inside_extra=coefficients.inside_extra.to(work_dtype),
            )
            if saved:
                kept = (chunk_pass.row_max, total, *coefficients_w, teacher_probs)
                for name, value in zip(_SAVED, kept, strict=True):
                    saved[name][part] = value
            if sink is None:
                continue
            logit_gradient_(
                work,
                chunk_pass.exp_teacher,
                chunk_teacher.index,
                chunk_teacher.owned,
                teacher_probs.to(work_dtype),
                total,
                coefficients_w,
                _row_scale(unit, clamped[part], counted[part], divisor, settings),
            )
            sink.add_bias(work)
            sink.keep_teacher_columns(part, work)
            if work is not logits:
                logits.copy_(work)  # the gradient, rounded once to the weight's dtype
        if sink is not None:
            sink.add_chunk(rows, block, hidden[rows])
    return _ForwardResults(columns=columns, clamped=clamped, saved=saved)


class FusedLinearTopKKLFunction(torch.autograd.Function):
    """The fused loss as one autograd node.

    `apply(hidden [N, H], weight [V_local, H], bias [V_local] | None, teacher, counted [N],
    settings)` returns `(loss, per_position, head, tail, teacher_mass, student_mass,
    overlap, clamped)`: `loss` reduced as `settings.reduction` says (`[N]` for "none"), the
    rest `[N]` diagnostics (`per_position` after the clamp; `clamped` bool). Only `loss` is
    differentiable.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        teacher: TeacherColumns,
        counted: Tensor,
        settings: FusedSettings,
    ) -> tuple[Tensor, ...]:
        needs_any = any(settings.needs_grad)
        grads_now = needs_any and settings.grad_in_forward and settings.reduction != "none"
        sink = (
            GradientSink(hidden, weight, bias, (teacher.index, teacher.owned), settings)
            if grads_now
            else None
        )
        results = _forward_chunks(
            hidden,
            weight,
            bias,
            teacher,
            counted,
            settings,
            sink,
            keep_for_backward=needs_any and not grads_now,
        )
        per_position = results.columns[0]
        loss = reduce_positions(per_position, counted, settings.reduction, per_position.shape)
        ctx.settings = settings
        ctx.has_bias = bias is not None
        ctx.precomputed = sink.finish() if sink is not None else None
        saved = results.saved
        if saved:
            ctx.save_for_backward(
                hidden,
                weight,
                bias,
                teacher.index,
                teacher.owned,
                counted,
                results.clamped,
                saved["row_max"],
                saved["total"],
                saved["outside"],
                saved["inside_extra"],
                saved["teacher_probs"],
            )
        outputs = (loss, *results.columns, results.clamped)
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *_diagnostic_grads: Tensor) -> tuple[Any, ...]:
        settings: FusedSettings = ctx.settings
        if ctx.precomputed is not None:
            grads = ctx.precomputed
            ctx.precomputed = None  # scaled in place below: a second backward cannot reuse them
            scaled = tuple(None if g is None else g.mul_(grad_loss) for g in grads)
        elif ctx.saved_tensors:
            scaled = _recomputed_gradients(ctx.saved_tensors, grad_loss, settings)
        else:
            raise RuntimeError(
                "lm_head_topk_kl_loss: backward ran twice through a loss whose gradients were "
                "computed in forward (retain_graph=True); call the loss again instead"
            )
        grad_hidden, grad_weight, grad_bias = scaled
        needs = ctx.needs_input_grad
        return (
            grad_hidden if needs[0] else None,
            grad_weight if needs[1] else None,
            grad_bias if ctx.has_bias and needs[2] else None,
            None,  # teacher: data, not a parameter
            None,  # counted
            None,  # settings
        )


def _recomputed_gradients(
    saved: tuple[Tensor, ...], grad_loss: Tensor, settings: FusedSettings
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Backward of the recompute mode: the chunk logits again, then the same gradient."""
    hidden, weight, bias, index, owned, counted, clamped = saved[:7]
    divisor = position_count(counted)
    scale = _row_scale(
        grad_loss.to(working_dtype(weight.dtype)), clamped, counted, divisor, settings
    )
    sink = GradientSink(hidden, weight, bias, (index, owned), settings)
    _backward_chunks(saved, scale, settings, sink)
    return sink.finish()


def _backward_chunks(
    saved: tuple[Tensor, ...], scale: Tensor, settings: FusedSettings, sink: GradientSink
) -> None:
    """The chunk loop of the recompute mode (buffers freed on return)."""
    hidden, weight, bias, index, owned = saved[:5]
    row_max, total, outside, inside_extra, teacher_probs = saved[7:]
    block_buffer, work_buffer = _buffers(hidden.shape[0], weight, settings)
    for rows in chunk_bounds(hidden.shape[0], settings.chunk_rows):
        block = _chunk_logits(hidden[rows], weight, bias, block_buffer[: rows.stop - rows.start])
        for sub in chunk_bounds(block.shape[0], settings.loss.chunk_rows):
            part = slice(rows.start + sub.start, rows.start + sub.stop)
            logits = block[sub]
            work = logits if work_buffer is None else work_buffer[: logits.shape[0]]
            recompute_logit_gradient_(
                work,
                logits,
                index[part],
                None if owned is None else owned[part],
                teacher_probs[part],
                row_max[part],
                total[part],
                GradientCoefficients(outside=outside[part], inside_extra=inside_extra[part]),
                scale[part],
                settings.loss,
            )
            sink.add_bias(work)
            sink.keep_teacher_columns(part, work)
            if work is not logits:
                logits.copy_(work)
        sink.add_chunk(rows, block, hidden[rows])


def fused_topk_kl(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    teacher: tuple[Tensor, Tensor, Tensor | None],
    counted: Tensor,
    settings: FusedSettings,
) -> KernelResult:
    """The fused kernel on already validated inputs, the chunked kernel's counterpart
    (`chunked.chunked_topk_kl`).

    Args:
        hidden: `[N, H]`.
        weight: this rank's `[V_local, H]`; `bias` `[V_local]` or None.
        teacher: the columns `(ids [N, K'], logprobs [N, K'], present [N, K'] | None)`
            (`support.py`).
        counted: bool `[N]`, the rows the reduction counts.
        settings: the call's options, chunk rows, vocab shard and needed gradients.

    Returns:
        A `KernelResult` (the loss clamped and reduced, differentiable w.r.t. `hidden`,
        `weight`, `bias`).
    """
    ids, logprobs, present = teacher
    shard = settings.loss.shard
    columns = localized_columns(ids, logprobs, present, shard, statistics_dtype(hidden.device))
    outputs = FusedLinearTopKKLFunction.apply(hidden, weight, bias, columns, counted, settings)
    loss, *terms, clamped = outputs
    return KernelResult(loss, RowTerms(*terms), clamped)
