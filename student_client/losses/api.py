"""`topk_kl_loss`: validation, masking, clamping and reduction around the chunked kernel."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from student_client.losses.chunked import ChunkedSettings, auto_chunk_rows, chunked_topk_kl_rows
from student_client.losses.masking import (
    counted_positions,
    masked_mean,
    neutralize_uncounted,
    reduce_positions,
)
from student_client.losses.parallel import VocabShard
from student_client.losses.types import LossMode, Reduction, RowTerms, TopKKLStats
from student_client.losses.validation import check_options, check_teacher_values, check_tensors

__all__ = ["topk_kl_loss"]


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

    The temperature applies to the student only (vLLM does not temper prompt log-probs),
    and the loss is not multiplied by `T**2`. No gradient flows to the teacher tensors.

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

    Returns:
        `(loss, stats)`: `loss` a scalar (or `[...]` for "none") in float32 (float64 for
        float64 logits), differentiable w.r.t. `logits`; `stats` a `TopKKLStats`.

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
    local_vocab, top_k = logits.shape[-1], teacher_ids.shape[-1]
    flat_logits = logits.reshape(-1, local_vocab)
    n_positions = flat_logits.shape[0]
    ids = teacher_ids.reshape(n_positions, top_k)
    logprobs = teacher_logprobs.detach().reshape(n_positions, top_k)
    counted = counted_positions(mask, n_positions, logits.device)
    check_teacher_values(ids[counted], logprobs[counted], shard.global_vocab)
    ids, logprobs = neutralize_uncounted(ids, logprobs, counted)

    settings = ChunkedSettings(
        tail_mode=mode == "tail",
        temperature=float(temperature),
        tail_mass_eps=float(tail_mass_eps),
        chunk_rows=chunk_size if chunk_size is not None else auto_chunk_rows(local_vocab),
        shard=shard,
    )
    rows = chunked_topk_kl_rows(flat_logits, ids, logprobs, settings)

    per_position = rows.loss
    clamped = torch.zeros_like(per_position, dtype=torch.bool)
    if clamp_min is not None:
        clamped = per_position.detach() < clamp_min
        per_position = per_position.clamp_min(clamp_min)

    loss = reduce_positions(per_position, counted, reduction, positions_shape)
    stats = _summarize(rows, per_position.detach(), clamped, counted)
    return loss, stats


def _summarize(
    rows: RowTerms, per_position: Tensor, clamped: Tensor, counted: Tensor
) -> TopKKLStats:
    """Means over the counted positions of the `[N]` per-position values (one host sync)."""
    columns = {
        "loss": per_position,
        "head_loss": rows.head,
        "tail_loss": rows.tail,
        "teacher_mass": rows.teacher_mass,
        "student_mass": rows.student_mass,
        "overlap": rows.overlap,
        "clamped_fraction": clamped.to(per_position.dtype),
    }
    means = masked_mean(torch.stack(list(columns.values()), dim=-1), counted).tolist()
    return TopKKLStats(**dict(zip(columns, means, strict=True)), positions=int(counted.sum()))
