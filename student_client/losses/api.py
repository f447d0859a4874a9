"""`topk_kl_loss` and `fused_topk_kl_loss`: validation, masking, clamping, reduction, stats
around the chunked and the fused kernels."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from student_client.losses.chunked import (
    ChunkedSettings,
    TeacherColumns,
    chunked_topk_kl_rows,
    statistics_dtype,
)
from student_client.losses.fused import (
    GRAD_ACCUMULATIONS,
    FusedLinearTopKKLFunction,
    FusedSettings,
    GradAccumulation,
)
from student_client.losses.masking import prepare_teacher_rows, reduce_positions, summarize
from student_client.losses.parallel import VocabShard
from student_client.losses.sizing import auto_chunk_rows, fused_chunks
from student_client.losses.types import LossMode, Reduction, RowTerms, TopKKLStats
from student_client.losses.validation import check_linear, check_options, check_tensors

__all__ = ["fused_topk_kl_loss", "topk_kl_loss"]


def topk_kl_loss(
    logits: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    mode: LossMode = "tail",
    mask: Tensor | None = None,
    reduction: Reduction = "mean",
    chunk_size: int | None = None,
    temperature: float = 1.0,
    tail_mass_eps: float = 1e-6,
    clamp_min: float | None = None,
    process_group: Any = None,
    validate: bool = True,
    overlap: bool = False,
) -> tuple[Tensor, TopKKLStats]:
    """Distillation loss of student logits against a teacher's top-k log-probs.

    Per position (docs/losses.md), with `q = softmax(z / T)`, teacher top-k set `I`,
    `p_i = exp(l_i)`, `P = sum_I p_i`, `Q = sum_I q_i`:

    - "truncated" (verl `forward_kl_topk`): `sum_I p_i (log p_i - log q_i)`. Not a KL: it is
      negative when `Q > P`. `clamp_min` (off by default) clamps it like verl does; clamped
      positions get no gradient and `stats.clamped_fraction` says how often it bit.
    - "tail" (K+1 categories): the above plus `(1-P) log((1-P)/(1-Q))`. Non-negative, a
      lower bound of the full KL, equal to it when K = V. `1-P` is clamped at 0 and `1-Q`
      at `tail_mass_eps` (below it the tail term is constant and gives no gradient).

    The temperature applies to the student only (a teacher serving at `T`,
    `--teacher-temperature`, has tempered its log-probs already), and the loss is not
    multiplied by `T**2`. No gradient flows to the teacher tensors.

    The loss runs row chunk by row chunk (`chunked.py`): peak extra memory is about one
    gradient-sized buffer in the logits' dtype plus one fp32 `[chunk, V_local]` block.

    Args:
        logits: student logits `[..., V_local]`: float32, bfloat16, float16 (float64 for
            checks). Leading dims that cannot be flattened without a copy (e.g. a strided
            slice) are copied once; pass contiguous logits.
        teacher_ids: `[..., K]` global vocabulary ids, any integer dtype, distinct within a
            position (a repeated id is a ValueError), `K <= V_local * world_size`.
        teacher_logprobs: `[..., K]` teacher log-probs, any float dtype, `<= 0` (up to
            1e-3 of rounding), no NaN (`-inf` allowed).
        mode: "tail" or "truncated".
        mask: `[...]` bool or 0/1: positions that count. Teacher rows of positions that do
            not count are ignored (not validated).
        reduction: "mean" over counted positions (0 when none count), "sum", or "none" for
            the per-position loss `[...]` (0 where not counted).
        chunk_size: rows per chunk; None picks it from a 64 MiB fp32 budget per chunk.
        temperature: student temperature `T > 0`.
        tail_mass_eps: guard of the student tail mass, in (0, 1).
        clamp_min: truncated mode only: lower clamp of the per-position loss (verl: 0.0).
        process_group: torch.distributed group whose ranks hold the vocabulary in rank order
            (rank `r`: ids `[r * V_local, (r + 1) * V_local)`); None: one process. Every rank
            passes the same teacher tensors and mask and gets the same loss and stats; the
            gradient it gets is that of its own shard.
        validate: check the teacher's values and the mask's (a few host syncs). False: no
            value checks, and the call never waits for the device (no `.item()`,
            `.tolist()`, `nonzero` or boolean indexing); invalid values then give undefined
            results instead of an error. Shape, dtype and option checks always run.
        overlap: compute `stats.overlap` (a `topk` over every `[chunk, V_local]` block and,
            sharded, one all-gather per chunk); False: `stats.overlap` is NaN.

    Returns:
        `(loss, stats)`: `loss` a scalar (or `[...]` for "none") in float32 (float64 for
        float64 logits), differentiable w.r.t. `logits`; `stats` a `TopKKLStats`, lazy:
        its numbers are copied to the host when first read.

    Raises:
        ValueError: naming the argument, for any invalid input.
    """
    check_options(
        mode=mode,
        reduction=reduction,
        chunk_size=chunk_size,
        temperature=temperature,
        tail_mass_eps=tail_mass_eps,
        clamp_min=clamp_min,
    )
    if not isinstance(logits, Tensor):
        raise ValueError(f"logits: must be a torch.Tensor, got {type(logits).__name__}")
    shard = VocabShard.from_group(process_group, logits.shape[-1] if logits.dim() else 0)
    check_tensors(logits, teacher_ids, teacher_logprobs, mask, global_vocab=shard.global_vocab)

    positions_shape = logits.shape[:-1]
    local_vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, local_vocab)
    ids, logprobs, counted = prepare_teacher_rows(
        teacher_ids,
        teacher_logprobs,
        mask,
        n_positions=flat_logits.shape[0],
        device=logits.device,
        global_vocab=shard.global_vocab,
        validate=validate,
    )

    settings = ChunkedSettings(
        tail_mode=mode == "tail",
        temperature=float(temperature),
        tail_mass_eps=float(tail_mass_eps),
        chunk_rows=chunk_size if chunk_size is not None else auto_chunk_rows(local_vocab),
        shard=shard,
        overlap=overlap,
    )
    rows = chunked_topk_kl_rows(flat_logits, ids, logprobs, settings)

    per_position = rows.loss
    clamped = torch.zeros_like(per_position, dtype=torch.bool)
    if clamp_min is not None:
        clamped = per_position.detach() < clamp_min
        per_position = per_position.clamp_min(clamp_min)

    loss = reduce_positions(per_position, counted, reduction, positions_shape)
    stats = summarize(rows, per_position.detach(), clamped, counted, overlap=overlap)
    return loss, stats


def fused_topk_kl_loss(
    hidden: Tensor,
    weight: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    *,
    mode: LossMode = "tail",
    mask: Tensor | None = None,
    reduction: Reduction = "mean",
    temperature: float = 1.0,
    chunk_size: int | None = None,
    tail_mass_eps: float = 1e-6,
    clamp_min: float | None = None,
    process_group: Any = None,
    bias: Tensor | None = None,
    validate: bool = True,
    overlap: bool = False,
    grad_in_forward: bool = True,
    grad_weight_accumulation: GradAccumulation = "weight",
) -> tuple[Tensor, TopKKLStats]:
    """`topk_kl_loss(hidden @ weight.T + bias, ...)` without ever forming the logits.

    Same math, options, validation, statistics and return value as `topk_kl_loss` (see
    there); the logits are computed chunk by chunk and multiplied straight into the
    gradients of `hidden`, `weight` and `bias` (`fused.py`).

    Args:
        hidden: last hidden states `[..., H]`: float32, bfloat16, float16 (float64 for checks).
        weight: the lm_head weight `[V_local, H]`, same dtype and device as `hidden`; under
            `process_group`, this rank's vocabulary shard (rank `r`: rows for ids
            `[r * V_local, (r + 1) * V_local)`).
        teacher_ids, teacher_logprobs, mode, mask, reduction, temperature, tail_mass_eps,
            clamp_min, validate, overlap: as in `topk_kl_loss`.
        chunk_size: rows per chunk (one `[chunk, V_local]` logits block in the weight's
            dtype); None: the rows in five equal chunks, each block within 64 MiB - 1 GiB
            (`sizing.fused_chunks`). The loss math runs on fp32 sub-blocks of 16 MiB (CPU).
        process_group: vocab-parallel group (as in `topk_kl_loss`). Every rank passes the
            same `hidden`, teacher tensors and mask and gets the same loss and stats. The
            gradient of `hidden` is already summed over the ranks (every rank gets the
            full one: do not all-reduce it again); `weight.grad` / `bias.grad` are those of
            the rank's shard (reduce them over data-parallel replicas as usual).
        bias: optional lm_head bias `[V_local]`.
        grad_in_forward: for "mean" / "sum", compute the gradients during forward (three
            matmuls per chunk; measured faster on CPU, docs/losses.md) when one is needed;
            False recomputes the chunk logits in backward (four). "none" always recomputes.
        grad_weight_accumulation: how a bf16 / fp16 `grad_weight` is summed over the row
            chunks: "weight" (default: in the weight's dtype, rounded once per chunk, no
            memory beyond the gradient), "compensated" (a second buffer of the gradient's
            size holds the rounding error), "float32" (an fp32 accumulator: 2x the gradient,
            3x at the end). docs/losses.md "Weight-gradient accumulation" has their errors.

    Returns:
        `(loss, stats)` as `topk_kl_loss`; `loss` is differentiable w.r.t. `hidden`,
        `weight` and `bias`. With gradients computed in forward, backward scales them by
        the upstream gradient in place, so the graph cannot be backpropagated twice.

    Raises:
        ValueError: naming the argument, for any invalid input.
    """
    check_options(
        mode=mode,
        reduction=reduction,
        chunk_size=chunk_size,
        temperature=temperature,
        tail_mass_eps=tail_mass_eps,
        clamp_min=clamp_min,
    )
    if grad_weight_accumulation not in GRAD_ACCUMULATIONS:
        raise ValueError(
            f"grad_weight_accumulation: must be one of {', '.join(map(repr, GRAD_ACCUMULATIONS))}"
            f", got {grad_weight_accumulation!r}"
        )
    if not isinstance(hidden, Tensor):
        raise ValueError(f"hidden: must be a torch.Tensor, got {type(hidden).__name__}")
    check_linear(hidden, weight, bias)
    shard = VocabShard.from_group(process_group, weight.shape[0])
    check_tensors(
        hidden,
        teacher_ids,
        teacher_logprobs,
        mask,
        global_vocab=shard.global_vocab,
        student_name="hidden",
        last_dim="H",
    )

    positions_shape = hidden.shape[:-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    ids, logprobs, counted = prepare_teacher_rows(
        teacher_ids,
        teacher_logprobs,
        mask,
        n_positions=flat_hidden.shape[0],
        device=hidden.device,
        global_vocab=shard.global_vocab,
        validate=validate,
    )
    index, owned = shard.localize(ids)
    teacher = TeacherColumns(
        index=index, owned=owned, logprobs=logprobs.to(statistics_dtype(hidden.device))
    )
    chunks = fused_chunks(
        flat_hidden.shape[0], weight.shape[0], weight.element_size(), weight.device, chunk_size
    )
    grad_enabled = torch.is_grad_enabled()
    settings = FusedSettings(
        loss=ChunkedSettings(
            tail_mode=mode == "tail",
            temperature=float(temperature),
            tail_mass_eps=float(tail_mass_eps),
            chunk_rows=chunks.work_rows,
            shard=shard,
            overlap=overlap,
        ),
        chunk_rows=chunks.block_rows,
        clamp_min=clamp_min,
        reduction=reduction,
        grad_in_forward=grad_in_forward,
        accumulation=grad_weight_accumulation,
        needs_grad=(
            grad_enabled and hidden.requires_grad,
            grad_enabled and weight.requires_grad,
            grad_enabled and bias is not None and bias.requires_grad,
        ),
    )
    outputs = FusedLinearTopKKLFunction.apply(flat_hidden, weight, bias, teacher, counted, settings)
    loss, per_position, head, tail, teacher_mass, student_mass, overlap_rows, clamped = outputs
    rows = RowTerms(per_position, head, tail, teacher_mass, student_mass, overlap_rows)
    stats = summarize(rows, per_position, clamped, counted, overlap=overlap)
    if reduction == "none":
        loss = loss.reshape(positions_shape)
    return loss, stats
