"""`DistillationConfig`: what the Trainer asks the teacher for and how the loss uses it.

One value holds the request options the Trainer's prefetcher sends
(:class:`~topk_protocol.requests.RequestOptions`: K, dtype, packed encoding, sampled
payloads, ...) and the loss options (:class:`~student_client.losses.LossOptions`); every
option and every combination is checked when the config is built, before any teacher
call or training step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from student_client.losses import LossOptions
from student_client.losses.sampled import sampled_options
from topk_protocol.requests import RequestOptions

__all__ = ["DistillationConfig"]


@dataclass(frozen=True)
class DistillationConfig:
    """How the Trainer distils.

    Attributes:
        request: the request options every teacher call of the Trainer is made with
            (:class:`~topk_protocol.requests.RequestOptions`; default top-16, float16):
            ``RequestOptions(64, encoding="packed")`` for packed payloads,
            ``RequestOptions(32, samples=32, seed=0)`` for a sampled payload (the loss is
            then the sampled loss).
        loss: every option of the KD term (:class:`~student_client.losses.LossOptions`:
            divergence, mode, support, temperature, chunk size, ``validate``, ...).
            Mode ``"tail_actual"`` needs ``request.include_sampled`` (the default);
            supports ``"student"`` / ``"union"`` need ``candidates``.
        candidates: C, the student's own top-C ids per position sent with each request
            (supports ``"student"`` / ``"union"``): the Trainer runs the student's forward
            without gradient on each batch as it prefetches it (one extra forward per
            batch, with weights up to ``prefetch_depth`` steps old; ``docs/huggingface.md``).
            0 (the default): none.
        alpha: weight of the model's cross-entropy on ``labels``: the loss is
            ``alpha * CE + (1 - alpha) * KD``; 0 (the default) is pure distillation.
        prefetch_depth: batches kept with the teacher ahead of the one training.
        fused: compute the KD term from the last hidden states and the LM head with
            ``causal_lm_topk_kl_loss`` (no ``[B, T, V]`` logits; under FSDP2 it runs
            inside the root unit's forward); pure distillation only (``alpha`` 0).
    """

    request: RequestOptions = field(default_factory=lambda: RequestOptions(16))
    loss: LossOptions = field(default_factory=LossOptions)
    candidates: int = 0
    alpha: float = 0.0
    prefetch_depth: int = 4
    fused: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.request, RequestOptions):
            raise ValueError(
                f"request: must be a RequestOptions, got {type(self.request).__name__}"
            )
        if not isinstance(self.loss, LossOptions):
            raise ValueError(f"loss: must be a LossOptions, got {type(self.loss).__name__}")
        if self.fused and self.alpha != 0.0:
            raise ValueError("fused: needs alpha = 0 (the CE term needs the logits)")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha: must lie in [0, 1], got {self.alpha}")
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth: must be >= 0, got {self.prefetch_depth}")
        if self.loss.reduction != "mean":
            raise ValueError(f"loss: reduction must be 'mean' here, got {self.loss.reduction!r}")
        if isinstance(self.candidates, bool) or not isinstance(self.candidates, int):
            raise ValueError(f"candidates: must be an int >= 0, got {self.candidates!r}")
        if self.candidates < 0:
            raise ValueError(f"candidates: must be >= 0, got {self.candidates}")
        self._check_combination()

    def _check_combination(self) -> None:
        """The loss options against what the request asks for."""
        request, loss = self.request, self.loss
        if request.sampled:
            sampled_options(loss)  # refuses the options the sampled loss cannot use
            if self.candidates:
                raise ValueError(
                    "candidates: a sampled request carries no candidates; ask a top-k "
                    "payload (samples 0) for support 'student' / 'union'"
                )
            return
        if loss.mode == "tail_actual" and not request.include_sampled:
            raise ValueError(
                "loss: mode 'tail_actual' needs the actual tokens' log-probs: "
                "request.include_sampled must be True"
            )
        if loss.support != "teacher" and self.candidates < 1:
            raise ValueError(
                f"candidates: support {loss.support!r} needs the student's candidates: "
                "set candidates to C >= 1"
            )
        if loss.support == "teacher" and self.candidates:
            raise ValueError(
                f"candidates: {self.candidates} asked with support 'teacher', which does not "
                "use them; set loss support to 'student' or 'union'"
            )
