"""``transformers.Trainer`` integration: distil a Hugging Face student against a teacher.

- :func:`distillation_loss` is the reusable piece: student forward on a batch, the
  tail-aware (or truncated) top-k KL against the payload aligned to the batch, optionally
  blended with the model's own cross-entropy, ``alpha * CE + (1 - alpha) * KD``. Use it
  in any loop (or another trainer's ``compute_loss``).
- :class:`TopKDistillationTrainer` is a ``Trainer`` whose ``compute_loss`` calls it. The
  payloads come from a teacher target (``"host:port"``, each process opens its own
  client), a client object (``TeacherClient``, ``ReplayClient``), or the batches
  themselves (a :class:`~student_client.dataset.PayloadDataset` with
  :func:`payload_dataset_collator`, or any collator that gives ``teacher_ids`` /
  ``teacher_logprobs`` / ``teacher_mask``). Payloads are prefetched: the hook is
  ``Trainer.get_batch_samples``, which pulls the micro-batches of each optimizer step
  from the (per-rank, already sharded) epoch iterator; the trainer wraps that iterator
  once per epoch in a client stream that keeps ``prefetch_depth`` batches with the
  teacher, so every rank fetches the payloads of exactly its own batches, in order,
  across gradient accumulation steps.
- Loss statistics (``kd_loss``, ``kd_teacher_mass``, ``kd_overlap``, ...) are kept as
  device tensors, averaged over the micro-batches since the last log and read (one host
  sync) only when ``Trainer.log`` runs, then averaged over the data-parallel ranks (one
  all-reduce): they land in ``trainer.state.log_history`` and every ``report_to``
  integration. With ``LossOptions(validate=False)`` a training step (forward, loss,
  backward) never waits for the device.
- Several teachers (``teacher={name: target, ...}``, multi-teacher distillation): each
  row goes to the teacher its ``teacher_column`` names (TRL's ``teacher_id`` by default;
  a name, or an index into the teachers, per row), through one
  :class:`~student_client.multi_client.MultiTeacherClient`; the ``kd_*`` statistics are
  logged overall and per teacher (``kd_loss/<name>``, ...). The collator must pass the
  column through (:func:`teacher_column_collator` wraps one that would drop it).

Needs the ``hf`` extra (``pip install 'topk-distill[hf]'``: transformers + accelerate).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    from transformers import Trainer
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "student_client.hf_trainer needs transformers and accelerate: "
        "pip install 'topk-distill[hf]'"
    ) from e

from student_client.alignment import PaddedLayout, place_rows
from student_client.client import ScoreBatch
from student_client.distributed import mean_over_ranks, rank_client_options
from student_client.losses import (
    LossOptions,
    causal_lm_topk_kl_loss,
    fused_topk_kl_loss,
    topk_kl_loss,
)
from student_client.losses.types import TopKKLStats
from student_client.payload import TeacherPayload
from student_client.routing import teacher_per_row

__all__ = [
    "PAYLOAD_KEYS",
    "DistillationConfig",
    "TopKDistillationTrainer",
    "distillation_loss",
    "payload_columns",
    "payload_dataset_collator",
    "per_teacher_metrics",
    "teacher_column_collator",
]

#: The batch column that names each row's teacher (TRL's convention), by default.
TEACHER_COLUMN = "teacher_id"

#: Batch keys that carry the teacher's payload (aligned to ``input_ids``): ``[B, T, K]``
#: ids, ``[B, T, K]`` log-probs, ``[B, T]`` bool mask, and (mode ``"tail_actual"``) the
#: ``[B, T]`` log-prob of the actual next token.
PAYLOAD_KEYS = ("teacher_ids", "teacher_logprobs", "teacher_mask", "teacher_sampled_logprobs")


@dataclass(frozen=True)
class DistillationConfig:
    """How the distillation loss is computed.

    Attributes:
        top_k: K requested from the teacher.
        loss: every option of the KD term (:class:`~student_client.losses.LossOptions`:
            divergence, mode, temperature, chunk size, ``validate``, ``tail_mass_eps``,
            ``clamp_min``, ``overlap``, ...). Mode ``"tail_actual"`` asks the teacher for
            the sampled log-probs and takes the actual tokens from ``input_ids``.
        alpha: weight of the model's cross-entropy on ``labels``: the loss is
            ``alpha * CE + (1 - alpha) * KD``; 0 (the default) is pure distillation.
        dtype: wire dtype of the teacher's log-probs.
        prefetch_depth: batches kept with the teacher ahead of the one training.
        fused: compute the KD term from the last hidden states and the LM head with
            ``causal_lm_topk_kl_loss`` (no ``[B, T, V]`` logits; under FSDP2 it runs
            inside the root unit's forward); pure distillation only (``alpha`` 0).
    """

    top_k: int = 16
    loss: LossOptions = field(default_factory=LossOptions)
    alpha: float = 0.0
    dtype: str = "float16"
    prefetch_depth: int = 4
    fused: bool = False

    def __post_init__(self) -> None:
        if self.fused and self.alpha != 0.0:
            raise ValueError("fused: needs alpha = 0 (the CE term needs the logits)")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha: must lie in [0, 1], got {self.alpha}")
        if self.top_k < 1:
            raise ValueError(f"top_k: must be >= 1, got {self.top_k}")
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth: must be >= 0, got {self.prefetch_depth}")
        if not isinstance(self.loss, LossOptions):
            raise ValueError(f"loss: must be a LossOptions, got {type(self.loss).__name__}")
        if self.loss.reduction != "mean":
            raise ValueError(f"loss: reduction must be 'mean' here, got {self.loss.reduction!r}")

    @property
    def include_sampled(self) -> bool:
        """Whether the teacher must send the sampled log-probs (mode ``"tail_actual"``)."""
        return self.loss.mode == "tail_actual"


def payload_columns(payload: TeacherPayload) -> dict[str, torch.Tensor]:
    """A payload aligned to a batch as the batch columns :data:`PAYLOAD_KEYS` (the sampled
    log-probs only when the payload has them)."""
    columns = {
        "teacher_ids": payload.ids,
        "teacher_logprobs": payload.logprobs,
        "teacher_mask": payload.mask,
    }
    if payload.sampled_logprobs is not None:
        columns["teacher_sampled_logprobs"] = payload.sampled_logprobs
    return columns


def payload_dataset_collator(pad_id: int = 0) -> Callable[[Sequence[Any]], dict[str, Any]]:
    """A ``data_collator`` for a :class:`~student_client.dataset.PayloadDataset`: its
    batches as Trainer inputs (``input_ids``, ``attention_mask`` and
    :data:`PAYLOAD_KEYS`, the payload placed at its positions of the ``[B, L]`` batch, so
    sub-range recordings line up with the full logits). Train with ``teacher=None``."""
    from student_client.dataset import collate_payloads

    def collate(items: Sequence[Any]) -> dict[str, Any]:
        batch = collate_payloads(items, pad_id=pad_id)
        b, length = batch.token_ids.shape
        payload = place_rows(batch.payload, PaddedLayout.dense(b, length))
        return {
            "input_ids": batch.token_ids,
            "attention_mask": batch.attention_mask.long(),
            **payload_columns(payload),
        }

    return collate


def distillation_loss(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    config: DistillationConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
    """Student forward + distillation loss of one batch.

    Args:
        model: a causal LM (``model(**inputs).logits`` is ``[B, T, V]``).
        inputs: the batch: the model's inputs (``input_ids``, ``attention_mask``, ...,
            ``labels`` when ``config.alpha > 0``) plus :data:`PAYLOAD_KEYS` (the payload
            aligned to ``input_ids``: row ``t`` is the teacher's distribution over the
            token after ``input_ids[:, t]``, as ``logits[:, t]``).
        config: see :class:`DistillationConfig`.

    Returns:
        ``(loss, metrics, outputs)``: the scalar loss (mean over the batch's counted
        positions), the metrics as detached 0-d device tensors (``kd_*`` from
        :meth:`TopKKLStats.tensors`, ``ce_loss`` when blended; reading them is a host
        sync), and the model's outputs.
    """
    missing = [k for k in PAYLOAD_KEYS[:2] if k not in inputs]
    if missing:
        raise ValueError(
            f"inputs: missing {missing}; the batch needs the teacher payload (use "
            f"TopKDistillationTrainer with a teacher, or a payload dataset)"
        )
    model_inputs = {k: v for k, v in inputs.items() if k not in PAYLOAD_KEYS}
    if config.alpha == 0.0:
        model_inputs.pop("labels", None)
    elif "labels" not in model_inputs:
        raise ValueError(f"inputs: alpha = {config.alpha} > 0 needs 'labels' for the CE term")
    teacher = {
        "mask": inputs.get("teacher_mask"),
        "options": config.loss,
        **_actual_tokens(inputs, config),
    }
    if config.fused:
        kd, stats, head = causal_lm_topk_kl_loss(
            model, model_inputs, inputs["teacher_ids"], inputs["teacher_logprobs"], **teacher
        )
        return kd, _stats_metrics(stats), head
    outputs = model(**model_inputs)
    kd, stats = topk_kl_loss(
        outputs.logits, inputs["teacher_ids"], inputs["teacher_logprobs"], **teacher
    )
    metrics = _stats_metrics(stats)
    if config.alpha == 0.0:
        return kd, metrics, outputs
    ce = outputs.loss
    metrics["ce_loss"] = ce.detach()
    return config.alpha * ce + (1.0 - config.alpha) * kd, metrics, outputs


def _actual_tokens(inputs: Mapping[str, Any], config: DistillationConfig) -> dict[str, Any]:
    """Mode ``"tail_actual"``: ``sampled_ids`` (``input_ids`` shifted left by one) and the
    payload's ``sampled_logprobs``; other modes: nothing."""
    if not config.include_sampled:
        return {}
    if "teacher_sampled_logprobs" not in inputs:
        raise ValueError(
            "inputs: mode 'tail_actual' needs 'teacher_sampled_logprobs' (the payload's "
            "sampled_logprobs)"
        )
    input_ids = inputs["input_ids"]
    sampled_ids = torch.roll(input_ids, -1, dims=-1)  # the last column has no next token
    return {"sampled_ids": sampled_ids, "sampled_logprobs": inputs["teacher_sampled_logprobs"]}


def _stats_metrics(stats: TopKKLStats) -> dict[str, torch.Tensor]:
    return {f"kd_{name}": value for name, value in stats.tensors().items()}


def _teacher_column(batch: Mapping[str, Any], column: str) -> Any:
    if column not in batch:
        raise ValueError(
            f"teacher_column: the batch has no {column!r} column (keys {sorted(batch)}); with "
            "several teachers every row names its teacher (see teacher_column_collator)"
        )
    return batch[column]


def teacher_column_collator(
    collator: Callable[[Sequence[Any]], Mapping[str, Any]], column: str = TEACHER_COLUMN
) -> Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]:
    """Wrap a ``data_collator`` that cannot take the teacher column (names are strings):
    the column is taken out of every example, the rest collated, and the names put back
    as a list, one per row."""

    def collate(features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        names = [f[column] for f in features]
        batch = collator([{k: v for k, v in f.items() if k != column} for f in features])
        return {**batch, column: names}

    return collate


@torch.no_grad()
def per_teacher_metrics(
    outputs: Any, inputs: Mapping[str, Any], config: DistillationConfig, teachers: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The ``kd_*`` statistics of each teacher's rows of a batch, as ``kd_<stat>/<name>``
    (detached 0-d device tensors, as :func:`distillation_loss`'s metrics).

    ``outputs`` is what :func:`distillation_loss` returned (the model's outputs with
    ``logits`` ``[B, T, V]``, or with ``config.fused`` the ``hidden`` ``[B, T, H]`` and
    head); ``teachers``: the ``B`` rows' teacher names. Computed again on each teacher's
    rows without gradient (the loss itself is the batch's, unchanged).
    """
    out: dict[str, torch.Tensor] = {}
    mask = inputs.get("teacher_mask")
    actual = _actual_tokens(inputs, config)
    for name in dict.fromkeys(teachers):
        rows = torch.tensor([i for i, t in enumerate(teachers) if t == name], dtype=torch.long)

        def take(t: torch.Tensor, rows: torch.Tensor = rows) -> torch.Tensor:
            return t[rows.to(t.device)]

        teacher: dict[str, Any] = {
            "mask": None if mask is None else take(mask),
            "options": config.loss,
            **{k: take(v) for k, v in actual.items()},
        }
        ids, lps = take(inputs["teacher_ids"]), take(inputs["teacher_logprobs"])
        if config.fused:
            _, stats = fused_topk_kl_loss(
                take(outputs.hidden), outputs.weight, ids, lps, bias=outputs.bias, **teacher
            )
        else:
            _, stats = topk_kl_loss(take(outputs.logits), ids, lps, **teacher)
        out.update({f"{k}/{name}": v for k, v in _stats_metrics(stats).items()})
    return out


class _Prefetcher:
    """Wraps one epoch iterator: yields its batches with their payload columns added,
    keeping ``depth`` batches with the teacher ahead of the one handed out."""

    def __init__(
        self,
        epoch_iterator: Iterator[Any],
        client: Any,
        config: DistillationConfig,
        teacher_column: str | None = None,
    ) -> None:
        self._pending: deque[Mapping[str, Any]] = deque()
        self._source = epoch_iterator
        self._column = teacher_column
        self._payloads = client.stream(
            self._to_teacher(),
            config.top_k,
            depth=config.prefetch_depth,
            dtype=config.dtype,
            include_sampled=config.include_sampled,
        )

    def _to_teacher(self) -> Iterator[ScoreBatch]:
        for batch in self._source:
            self._pending.append(batch)
            yield ScoreBatch(
                batch["input_ids"],
                attention_mask=batch.get("attention_mask"),
                teacher=None if self._column is None else _teacher_column(batch, self._column),
            )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        payload: TeacherPayload = next(self._payloads)
        batch = self._pending.popleft()
        device = batch["input_ids"].device
        return {**batch, **payload_columns(payload.to(device))}

    def close(self) -> None:
        close = getattr(self._payloads, "close", None)
        if close is not None:
            close()


class TopKDistillationTrainer(Trainer):
    """A ``transformers.Trainer`` that trains the student on a teacher's top-k payloads.

    Args:
        teacher: where payloads come from: a target (``"host:port"``, ``"dns:///..."``
            or a list; this process opens its own ``TeacherClient``), several named
            teachers ``{name: target, ...}`` (a ``MultiTeacherClient``; rows routed by
            ``teacher_column``), a client object with ``stream`` (``TeacherClient``,
            ``ReplayClient``, ``MultiTeacherClient``), or None when the batches already
            carry :data:`PAYLOAD_KEYS` (a payload dataset).
        teacher_column: the batch column naming each row's teacher, with several
            teachers (default ``"teacher_id"``).
        distill: :class:`DistillationConfig` (K, mode, alpha, prefetch depth, ...).
        teacher_kwargs: extra ``TeacherClient`` arguments when ``teacher`` is a target
            (``token``, ``tls``, ``expect_vocab_size``, ...).
        *args, **kwargs: ``transformers.Trainer``'s (model, args, train_dataset,
            data_collator, ...).

    Batches need ``input_ids`` (and ``attention_mask`` for padded batches: padding is
    never sent to the teacher). Training batches are prefetched; a batch that arrives
    without its payload (evaluation) is scored on the spot. The KD loss is a per-batch
    mean over the counted positions; the Trainer divides it by the gradient accumulation
    steps as usual.
    """

    def __init__(
        self,
        *args: Any,
        teacher: str | Sequence[str] | Any = None,
        distill: DistillationConfig | None = None,
        teacher_kwargs: dict[str, Any] | None = None,
        teacher_column: str = TEACHER_COLUMN,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.distill = distill or DistillationConfig()
        self.teacher_column = teacher_column
        self._owns_client = isinstance(teacher, str | Mapping) or (
            isinstance(teacher, Sequence) and all(isinstance(t, str) for t in teacher)
        )
        # One client per data-parallel rank; a recording per rank (distributed.py).
        options = rank_client_options(teacher_kwargs, self.args.process_index, self.args.world_size)
        if isinstance(teacher, Mapping):
            from student_client.multi_client import MultiTeacherClient

            self.teacher_client: Any = MultiTeacherClient(teacher, **options)
        elif self._owns_client:
            from student_client.client import TeacherClient

            self.teacher_client = TeacherClient(teacher, **options)
        else:
            if teacher is not None and not hasattr(teacher, "stream"):
                raise TypeError(
                    f"teacher: expected a target string, a client with stream(), or None; "
                    f"got {type(teacher).__name__}"
                )
            self.teacher_client = teacher
        # The loss is a per-micro-batch mean: the Trainer scales it for accumulation.
        self.loss_is_scaled_for_ga = False
        self._prefetchers: dict[int, _Prefetcher] = {}
        self._kd_metrics: dict[str, list[torch.Tensor]] = defaultdict(list)

    # -- data: payload columns survive column removal; payloads prefetched per epoch ---
    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        assert self._signature_columns is not None
        keep = [*PAYLOAD_KEYS, self.teacher_column]
        self._signature_columns += [k for k in keep if k not in self._signature_columns]

    @property
    def teacher_names(self) -> list[str] | None:
        """The teachers rows are routed to (several teachers), else None."""
        names = getattr(self.teacher_client, "names", None)
        return list(names) if names else None

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], Any]:
        if self.teacher_client is not None:
            key = id(epoch_iterator)
            if key not in self._prefetchers:
                for old in self._prefetchers.values():
                    old.close()
                # Keep the iterator alive with its wrapper so that its id stays unique.
                column = self.teacher_column if self.teacher_names else None
                self._prefetchers = {
                    key: _Prefetcher(epoch_iterator, self.teacher_client, self.distill, column)
                }
            epoch_iterator = self._prefetchers[key]
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    # -- loss and logging ---------------------------------------------------------------
    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        names = self.teacher_names
        teachers = None
        if names is not None:
            teachers = teacher_per_row(
                _teacher_column(inputs, self.teacher_column), len(inputs["input_ids"]), names
            )
            inputs = {k: v for k, v in inputs.items() if k != self.teacher_column}
        if PAYLOAD_KEYS[0] not in inputs and self.teacher_client is not None:
            # Not prefetched (evaluation, prediction): fetch this batch's payload now.
            cfg = self.distill
            route = {} if teachers is None else {"teacher": teachers}
            payload = self.teacher_client.score(
                inputs["input_ids"],
                cfg.top_k,
                dtype=cfg.dtype,
                include_sampled=cfg.include_sampled,
                attention_mask=inputs.get("attention_mask"),
                **route,
            )
            inputs = {**inputs, **payload_columns(payload.to(inputs["input_ids"].device))}
        loss, metrics, outputs = distillation_loss(model, inputs, self.distill)
        if teachers is not None and len(set(teachers)) > 1:
            metrics.update(per_teacher_metrics(outputs, inputs, self.distill, teachers))
        elif teachers is not None:  # one teacher: its statistics are the batch's
            kd = {k: v for k, v in metrics.items() if k.startswith("kd_")}
            metrics.update({f"{k}/{teachers[0]}": v for k, v in kd.items()})
        if model.training:
            for name, value in metrics.items():
                self._kd_metrics[name].append(value)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Evaluation: the distillation loss of the batch (``eval_loss``); no logits are
        gathered (the batches carry no labels to compare them with)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the distillation statistics (means since the last log) to ``logs``: the
        only place they are copied to the host (one sync)."""
        if "loss" in logs and self._kd_metrics:
            names = list(self._kd_metrics)
            means = torch.stack(
                [torch.stack(self._kd_metrics[name]).double().mean() for name in names]
            )
            # Every rank logs (the Trainer gathers the loss first): mean over the ranks.
            logs.update(mean_over_ranks(dict(zip(names, means.tolist(), strict=True))))
            self._kd_metrics.clear()
        super().log(logs, start_time)

    def close(self) -> None:
        """Stop prefetching; close the client when this trainer opened it."""
        for pre in self._prefetchers.values():
            pre.close()
        self._prefetchers.clear()
        if self._owns_client and self.teacher_client is not None:
            self.teacher_client.close()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            for pre in self._prefetchers.values():
                pre.close()
            self._prefetchers.clear()
