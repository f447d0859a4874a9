"""`topk_kl_loss`: the loss on student logits `[..., V_local]`, chunked over rows
(`kernels/chunked.py`), vocab-parallel aware, with an analytic backward."""

from __future__ import annotations

from torch import Tensor

from student_client.losses.kernels.chunked import chunked_topk_kl
from student_client.losses.kernels.settings import ChunkedSettings
from student_client.losses.masking import finish_loss
from student_client.losses.options import LossOptions, loss_options
from student_client.losses.parallel import VocabShard
from student_client.losses.sizing import auto_chunk_rows
from student_client.losses.support import TeacherRows
from student_client.losses.teacher import TeacherTargets
from student_client.losses.teacher_rows import teacher_rows
from student_client.losses.types import TopKKLStats

__all__ = ["topk_kl_loss"]


def topk_kl_loss(
    logits: Tensor, teacher: TeacherTargets, options: LossOptions | None = None
) -> tuple[Tensor, TopKKLStats]:
    """Distillation loss of student logits against a teacher's top-k log-probs.

    Per position (docs/losses.md), with `q = softmax(z / T)`, teacher top-k set `I`,
    `p_i = exp(l_i)`, `P = sum_I p_i`, `Q = sum_I q_i`, the loss is a divergence between
    coarse-grained distributions (`options.divergence`: forward KL by default, reverse KL,
    generalized JSD):

    - "tail" (K+1 categories, the top-k and the tail with masses `1-P`, `1-Q`): forward
      KL `sum_I p_i (log p_i - log q_i) + (1-P) log((1-P)/(1-Q))`. Non-negative, a lower
      bound of the full divergence, equal to it when K = V. `1-P` is clamped at 0 and
      `1-Q` at `tail_mass_eps` (below it the tail term is constant, no gradient).
    - "truncated" (forward KL only; verl `forward_kl_topk`): `sum_I p_i (log p_i - log
      q_i)`. Not a KL: negative when `Q > P`. `clamp_min` clamps it like verl does.
    - "tail_actual" (K+2): as "tail", with the actual next token `y` (`sampled_ids`, its
      teacher log-prob `sampled_logprobs`) in a category of its own where it is outside
      `I` (elsewhere, and where its log-prob is NaN, K+1 as "tail").

    `options.support` chooses `I` (docs/losses.md, "Supports"): "teacher" (the default,
    the teacher's top-k), "student" (the candidates: `candidate_ids` with the teacher's
    `candidate_logprobs`) or "union" (the top-k and the candidates, each id once); the
    formulas above hold with `P`, `Q` the masses on `I`. In mode "tail_actual" the actual
    token gets its own category where it is outside `I`.

    The temperature applies to the student only, and the loss is not multiplied by
    `T**2`. No gradient flows to the teacher tensors. The loss runs row chunk by row chunk
    (`kernels/chunked.py`): peak extra memory is about one gradient-sized buffer in the logits'
    dtype plus one fp32 `[chunk, V_local]` block.

    Args:
        logits: student logits `[..., V_local]`: float32, bfloat16, float16 (float64 for
            checks). Leading dims that cannot be flattened without a copy (e.g. a strided
            slice) are copied once; pass contiguous logits.
        teacher: a `TeacherTargets` (`TeacherTargets.from_payload(payload, ...)`): the
            top-k `ids` `[..., K]` (global ids, distinct within a position,
            `K <= V_local * world_size`) and `logprobs` `[..., K]` (`<= 0` up to 1e-3 of
            rounding, no NaN), the `mask` `[...]` (teacher rows of positions that do not
            count are ignored, not validated), mode "tail_actual"'s `sampled_ids` /
            `sampled_logprobs` `[...]`, supports "student" / "union"'s `candidate_ids` /
            `candidate_logprobs` `[..., C]`. With `sample_counts` the loss is the sampled
            loss (`sampled.py`): the forward KL against the unbiased target of the draws.
        options: a `LossOptions` (default `LossOptions()`): divergence, mode, support,
            reduction, chunk size, temperature, guards, process group, validate,
            overlap. Under `process_group` every rank passes the same teacher value and
            gets the same loss and stats; the gradient it gets is that of its own shard.
            With `validate=False` the call never waits for the device (invalid values
            then give undefined results instead of an error).

    Returns:
        `(loss, stats)`: `loss` a scalar (or `[...]` for "none") in float32 (float64 for
        float64 logits), differentiable w.r.t. `logits`; `stats` a `TopKKLStats`, lazy:
        its numbers are copied to the host when first read.

    Raises:
        ValueError: naming the argument, for any invalid input.

    Example:
        >>> import torch
        >>> from student_client.losses import TeacherTargets, topk_kl_loss
        >>> logits = torch.zeros(2, 3, 10, requires_grad=True)  # [B, T, V]: q uniform
        >>> teacher = TeacherTargets(  # the teacher's top-2 at each of 2 x 3 positions
        ...     ids=torch.tensor([0, 1]).repeat(2, 3, 1),
        ...     logprobs=torch.tensor([0.5, 0.25]).log().repeat(2, 3, 1),
        ... )
        >>> loss, stats = topk_kl_loss(logits, teacher)
        >>> round(loss.item(), 4), stats.teacher_mass, round(stats.student_mass, 4)
        (0.743, 0.75, 0.2)
        >>> loss.backward()
        >>> logits.grad.shape
        torch.Size([2, 3, 10])
    """
    opts = loss_options(options)
    if not isinstance(logits, Tensor):
        raise ValueError(f"logits: must be a torch.Tensor, got {type(logits).__name__}")
    shard = VocabShard.from_group(opts.process_group, logits.shape[-1] if logits.dim() else 0)
    opts, rows = teacher_rows(logits, teacher, opts, shard, {})
    return chunked_loss(logits, rows, opts, shard)


def chunked_loss(
    logits: Tensor, teacher: TeacherRows, opts: LossOptions, shard: VocabShard
) -> tuple[Tensor, TopKKLStats]:
    """The chunked kernel on validated inputs (`logits` `[..., V_local]`; it clamps and
    reduces the rows itself) and the step after the kernel (`masking.finish_loss`); top-k
    or sampled."""
    positions_shape = logits.shape[:-1]
    local_vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, local_vocab)
    chunk_rows = opts.chunk_size if opts.chunk_size is not None else auto_chunk_rows(local_vocab)
    settings = ChunkedSettings(opts, shard, chunk_rows, teacher.teacher_columns)
    result = chunked_topk_kl(
        flat_logits, teacher.ids, teacher.logprobs, teacher.counted, settings, teacher.present
    )
    return finish_loss(
        result,
        teacher,
        reduction=opts.reduction,
        positions_shape=positions_shape,
        overlap=opts.overlap,
    )
