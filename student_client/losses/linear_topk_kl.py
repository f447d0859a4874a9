"""`linear_topk_kl_loss`: the loss on `hidden @ weight.T + bias` without forming the
logits (`kernels/fused.py`); the lm_head path's kernel call (`lm_head_topk_kl_loss`)."""

from __future__ import annotations

import torch
from torch import Tensor

from student_client.losses.input_checks import check_linear
from student_client.losses.kernels.fused import fused_topk_kl
from student_client.losses.kernels.settings import ChunkedSettings, FusedSettings
from student_client.losses.masking import finish_loss
from student_client.losses.options import LossOptions
from student_client.losses.parallel import VocabShard
from student_client.losses.sizing import fused_chunks
from student_client.losses.support import TeacherRows
from student_client.losses.teacher import TeacherTargets
from student_client.losses.teacher_rows import teacher_rows
from student_client.losses.types import TopKKLStats

__all__ = ["linear_topk_kl_loss"]


def linear_topk_kl_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    teacher: TeacherTargets,
    opts: LossOptions,
) -> tuple[Tensor, TopKKLStats]:
    """`topk_kl_loss(hidden @ weight.T + bias, teacher, opts)` without ever forming the
    logits (`kernels/fused.py`): `hidden` `[..., H]`, `weight` `[V_local, H]` (this rank's
    vocabulary shard under `process_group`), `bias` `[V_local]` or None. The lm_head
    path's kernel (`lm_head_topk_kl_loss`)."""
    if not isinstance(hidden, Tensor):
        raise ValueError(f"hidden: must be a torch.Tensor, got {type(hidden).__name__}")
    check_linear(hidden, weight, bias)
    shard = VocabShard.from_group(opts.process_group, weight.shape[0])
    opts, rows = teacher_rows(hidden, teacher, opts, shard, _HIDDEN)
    return fused_loss(hidden, weight, bias, rows, opts, shard)


_HIDDEN = {"student_name": "hidden", "last_dim": "H"}


def fused_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    rows_in: TeacherRows,
    opts: LossOptions,
    shard: VocabShard,
) -> tuple[Tensor, TopKKLStats]:
    """The fused kernel on validated inputs (`hidden` `[..., H]`; it clamps and reduces
    the rows itself, as the chunked kernel does) and the step after the kernel
    (`masking.finish_loss`); top-k or sampled."""
    positions_shape = hidden.shape[:-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    chunks = fused_chunks(
        flat_hidden.shape[0], weight.shape[0], weight.element_size(), weight.device, opts.chunk_size
    )
    grad_enabled = torch.is_grad_enabled()
    settings = FusedSettings(
        loss=ChunkedSettings(opts, shard, chunks.work_rows, rows_in.teacher_columns),
        chunk_rows=chunks.block_rows,
        needs_grad=(
            grad_enabled and hidden.requires_grad,
            grad_enabled and weight.requires_grad,
            grad_enabled and bias is not None and bias.requires_grad,
        ),
    )
    result = fused_topk_kl(
        flat_hidden,
        weight,
        bias,
        (rows_in.ids, rows_in.logprobs, rows_in.present),
        rows_in.counted,
        settings,
    )
    return finish_loss(
        result,
        rows_in,
        reduction=opts.reduction,
        positions_shape=positions_shape,
        overlap=opts.overlap,
    )
