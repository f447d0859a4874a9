"""`LossOptions`: every option of the losses, written once.

Every loss (`topk_kl_loss`, `lm_head_topk_kl_loss`, `causal_lm_topk_kl_loss`, `TopKKLLoss`,
`topk_kl_reference`) and `DistillationConfig` take one `LossOptions` (`options=`), the only
way options reach a loss; the value is checked when it is built (`dataclasses.replace`
builds a variant, checked again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from student_client.losses.divergences import Divergence, get_divergence
from student_client.losses.input_checks import check_options
from student_client.losses.types import (
    GRAD_ACCUMULATIONS,
    GradAccumulation,
    LossMode,
    Reduction,
    Support,
)

__all__ = ["DEFAULT_OPTIONS", "LossOptions", "loss_options"]


@dataclass(frozen=True)
class LossOptions:
    """How the distillation loss is computed (docs/losses.md).

    Attributes:
        divergence: "forward" (`KL(p̂ || q̂)`, the default), "reverse" (`KL(q̂ || p̂)`),
            "jsd" (generalized Jensen-Shannon, `beta` 0.5), or a divergence object
            (`divergences.get_divergence("jsd", beta=0.3)`); stored as the object.
        mode: "tail" (K+1 categories: top-k + tail), "truncated" (the top-k terms alone,
            forward KL only: verl `forward_kl_topk`), or "tail_actual" (K+2: the actual
            next token gets its own category when it is outside the top-k; needs
            `sampled_ids` / `sampled_logprobs`).
        support: which ids get a category of their own (docs/losses.md, "Supports"):
            "teacher" (the default: the teacher's top-k), "student" (the student's
            candidates, `candidate_ids` / `candidate_logprobs`), "union" (both, each id
            once). The rest of the vocabulary is the tail bucket (tail modes). In mode
            "tail_actual" the actual token gets its own category where it is outside the
            support, whichever it is.
        reduction: "mean" over counted positions (0 when none count), "sum", or "none"
            for the per-position loss `[...]` (0 where not counted).
        chunk_size: rows per chunk; None picks it from the memory budget (`topk_kl_loss`:
            64 MiB of fp32 per chunk; fused: six equal row chunks, `sizing.py`).
        temperature: student temperature `T > 0` (the teacher's log-probs are used as
            they come; the loss is not multiplied by `T**2`).
        tail_mass_eps: guard of the student's tail mass (and, for the reverse KL, of the
            teacher's), in (0, 1): below it the tail term is constant (no gradient).
        clamp_min: truncated mode only: lower clamp of the per-position loss (verl: 0.0);
            clamped positions get no gradient.
        process_group: torch.distributed group whose ranks hold the vocabulary in rank
            order; None: one process.
        validate: check the teacher's values and the mask's (a few host syncs); False:
            the call never waits for the device.
        overlap: compute `stats.overlap` (a `topk` per block); False: it is NaN.
        grad_in_forward: fused loss only: compute the gradients in forward for "mean" /
            "sum" (three matmuls per chunk); False recomputes the logits in backward.
        grad_weight_accumulation: fused loss only: how a bf16 / fp16 `grad_weight` is
            summed over the row chunks: "weight" (in the weight's dtype, rounded once per
            chunk, no memory beyond the gradient), "compensated" (a second buffer of the
            gradient's size keeps the rounding error), "float32" (an fp32 accumulator: 2x
            the gradient, 3x while rounding). docs/lm_head_loss.md, "Weight-gradient accumulation".
    """

    divergence: str | Divergence = "forward"
    mode: LossMode = "tail"
    support: Support = "teacher"
    reduction: Reduction = "mean"
    chunk_size: int | None = None
    temperature: float = 1.0
    tail_mass_eps: float = 1e-6
    clamp_min: float | None = None
    process_group: Any = None
    validate: bool = True
    overlap: bool = False
    grad_in_forward: bool = True
    grad_weight_accumulation: GradAccumulation = "weight"

    def __post_init__(self) -> None:
        resolved = get_divergence(self.divergence)
        object.__setattr__(self, "divergence", resolved)
        check_options(
            mode=self.mode,
            support=self.support,
            overlap=self.overlap,
            reduction=self.reduction,
            chunk_size=self.chunk_size,
            temperature=self.temperature,
            tail_mass_eps=self.tail_mass_eps,
            clamp_min=self.clamp_min,
            truncatable=resolved.truncatable,
            divergence_name=resolved.name,
        )
        if self.grad_weight_accumulation not in GRAD_ACCUMULATIONS:
            raise ValueError(
                "grad_weight_accumulation: must be one of "
                f"{', '.join(map(repr, GRAD_ACCUMULATIONS))}, got {self.grad_weight_accumulation!r}"
            )

    @property
    def resolved_divergence(self) -> Divergence:
        """The divergence object (`divergence` after construction)."""
        divergence = self.divergence
        assert not isinstance(divergence, str)  # resolved in __post_init__
        return divergence


DEFAULT_OPTIONS = LossOptions()
"""What `options=None` means: `LossOptions()` (frozen, so one value serves every call)."""


def loss_options(options: LossOptions | None) -> LossOptions:
    """`options`, or `DEFAULT_OPTIONS` for None; anything else is a ValueError."""
    if options is None:
        return DEFAULT_OPTIONS
    if not isinstance(options, LossOptions):
        raise ValueError(f"options: must be a LossOptions, got {type(options).__name__}")
    return options
