"""``transformers.Trainer`` integration: distil a Hugging Face student against a teacher.

- :func:`~student_client.integrations.distillation.distillation_loss` is the reusable
  piece (pure torch, importable without transformers): student forward on a batch, the
  tail-aware (or truncated) top-k KL against the payload aligned to the batch, optionally
  blended with the model's own cross-entropy. Use it in any loop.
- :class:`TopKDistillationTrainer` is a ``Trainer`` whose ``compute_loss`` calls it. The
  payloads come from a teacher target (``"host:port"``, each process opens its own
  client), a client object (``TeacherClient``, ``ReplayClient``), or the batches
  themselves (a :class:`~student_client.offline.dataset.PayloadDataset` with
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
  :class:`~student_client.clients.multi_teacher.MultiTeacherClient`; the ``kd_*`` statistics are
  logged overall and per teacher (``kd_loss/<name>``, ...). The collator must pass the
  column through (:func:`teacher_column_collator` wraps one that would drop it).

Needs the ``hf`` extra (``pip install 'topk-distill[hf]'``: transformers + accelerate).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any

import torch

try:
    from transformers import Trainer
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "student_client.integrations.hf_trainer needs transformers and accelerate: "
        "pip install 'topk-distill[hf]'"
    ) from e

from student_client.clients.blocking import TeacherClient
from student_client.clients.multi_teacher import MultiTeacherClient
from student_client.clients.routing import teacher_per_row
from student_client.clients.sources import TeacherSource
from student_client.data.alignment import PaddedLayout, place_rows
from student_client.data.batch import ScoreBatch
from student_client.data.payload import TeacherPayload
from student_client.integrations.distillation import (
    TEACHER_KEY,
    distillation_loss,
    per_teacher_metrics,
)
from student_client.integrations.distillation_config import DistillationConfig
from student_client.integrations.distributed import mean_over_ranks, rank_client_options

__all__ = [
    "TEACHER_KEY",
    "DistillationConfig",
    "TopKDistillationTrainer",
    "distillation_loss",
    "payload_dataset_collator",
    "per_teacher_metrics",
    "teacher_column_collator",
]

#: The batch column that names each row's teacher (TRL's convention), by default.
TEACHER_COLUMN = "teacher_id"


def payload_dataset_collator(pad_id: int = 0) -> Callable[[Sequence[Any]], dict[str, Any]]:
    """A ``data_collator`` for a :class:`~student_client.offline.dataset.PayloadDataset`: its
    batches as Trainer inputs (``input_ids``, ``attention_mask`` and, under
    :data:`TEACHER_KEY`, the payload placed at its positions of the ``[B, L]`` batch, so
    sub-range recordings line up with the full logits). Train with ``teacher=None``."""
    from student_client.offline.dataset import collate_payloads

    def collate(items: Sequence[Any]) -> dict[str, Any]:
        batch = collate_payloads(items, pad_id=pad_id)
        b, length = batch.token_ids.shape
        payload = place_rows(batch.payload, PaddedLayout.dense(b, length))
        return {
            "input_ids": batch.token_ids,
            "attention_mask": batch.attention_mask.long(),
            TEACHER_KEY: payload,
        }

    return collate


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
def student_candidates(
    model: torch.nn.Module, batch: Mapping[str, Any], count: int
) -> torch.Tensor:
    """The student's own top-``count`` ids at every position of ``batch``, ``[B, T, C]``
    (``-1`` where ``attention_mask`` is 0): one forward without gradient, for supports
    ``"student"`` / ``"union"`` (the candidates the teacher scores)."""
    mask = batch.get("attention_mask")
    logits = model(input_ids=batch["input_ids"], attention_mask=mask).logits
    ids = logits.topk(count, dim=-1).indices
    if mask is not None:
        ids = ids.masked_fill(~mask.bool().unsqueeze(-1), -1)
    return ids.cpu()


def _score_batch(
    batch: Mapping[str, Any], teacher: Any, config: DistillationConfig, model: torch.nn.Module
) -> ScoreBatch:
    """What the teacher is asked for one training batch (with the student's candidates
    when the config asks for them)."""
    candidates = None
    if config.candidates:
        candidates = student_candidates(model, batch, config.candidates)
    return ScoreBatch(
        batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        teacher=teacher,
        candidate_ids=candidates,
    )


class _Prefetcher:
    """Wraps one epoch iterator: yields its batches with their payload added (under
    :data:`TEACHER_KEY`), keeping ``depth`` batches with the teacher ahead of the one
    handed out."""

    def __init__(
        self,
        epoch_iterator: Iterator[Any],
        client: TeacherSource,
        config: DistillationConfig,
        model: torch.nn.Module,
        teacher_column: str | None = None,
    ) -> None:
        self._pending: deque[Mapping[str, Any]] = deque()
        self._source = epoch_iterator
        self._column = teacher_column
        self._config = config
        self._model = model
        self._payloads = client.stream(
            self._to_teacher(), config.request, depth=config.prefetch_depth
        )

    def _to_teacher(self) -> Iterator[ScoreBatch]:
        for batch in self._source:
            self._pending.append(batch)
            teacher = None if self._column is None else _teacher_column(batch, self._column)
            yield _score_batch(batch, teacher, self._config, self._model)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        payload: TeacherPayload = next(self._payloads)
        batch = self._pending.popleft()
        device = batch["input_ids"].device
        return {**batch, TEACHER_KEY: payload.to(device)}

    def close(self) -> None:
        if isinstance(self._payloads, Generator):  # the clients' streams are generators
            self._payloads.close()


class TopKDistillationTrainer(Trainer):
    """A ``transformers.Trainer`` that trains the student on a teacher's top-k payloads.

    Args:
        teacher: where payloads come from: a target (``"host:port"``, ``"dns:///..."``
            or a list; this process opens its own ``TeacherClient``), several named
            teachers ``{name: target, ...}`` (a ``MultiTeacherClient``; rows routed by
            ``teacher_column``), a client object with ``stream`` (``TeacherClient``,
            ``ReplayClient``, ``MultiTeacherClient``), or None when the batches already
            carry their payload under :data:`TEACHER_KEY` (a payload dataset).
        teacher_column: the batch column naming each row's teacher, with several
            teachers (default ``"teacher_id"``).
        distill: :class:`DistillationConfig` (the request options the teacher is asked
            with, the loss options, candidates, alpha, prefetch depth, ...), checked when
            it is built.
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
        teacher: str | Sequence[str] | Mapping[str, Any] | TeacherSource | None = None,
        distill: DistillationConfig | None = None,
        teacher_kwargs: dict[str, Any] | None = None,
        teacher_column: str = TEACHER_COLUMN,
        **kwargs: Any,
    ) -> None:
        is_target = isinstance(teacher, str) or (
            isinstance(teacher, Sequence) and all(isinstance(t, str) for t in teacher)
        )
        if not (teacher is None or is_target or isinstance(teacher, Mapping | TeacherSource)):
            raise TypeError(
                "teacher: expected a target string, {name: target}, a client (a "
                f"student_client.clients.sources.TeacherSource), or None; got "
                f"{type(teacher).__name__}"
            )
        super().__init__(*args, **kwargs)
        self.distill = distill or DistillationConfig()
        self.teacher_column = teacher_column
        self._owns_client = not (teacher is None or isinstance(teacher, TeacherSource))
        self.teacher_client: TeacherSource | None = None
        # One client per data-parallel rank; a recording per rank (distributed.py).
        options = rank_client_options(teacher_kwargs, self.args.process_index, self.args.world_size)
        if isinstance(teacher, TeacherSource):
            self.teacher_client = teacher
        elif isinstance(teacher, Mapping):
            self.teacher_client = MultiTeacherClient(teacher, **options)
        elif teacher is not None:  # a target (checked above)
            self.teacher_client = TeacherClient(teacher, **options)
        # The loss is a per-micro-batch mean: the Trainer scales it for accumulation.
        self.loss_is_scaled_for_ga = False
        self._prefetchers: dict[int, _Prefetcher] = {}
        self._kd_metrics: dict[str, list[torch.Tensor]] = defaultdict(list)

    # -- data: payload columns survive column removal; payloads prefetched per epoch ---
    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        assert self._signature_columns is not None
        keep = [TEACHER_KEY, self.teacher_column]
        self._signature_columns += [k for k in keep if k not in self._signature_columns]

    @property
    def teacher_names(self) -> list[str] | None:
        """The teachers rows are routed to (several teachers), else None."""
        names = [] if self.teacher_client is None else self.teacher_client.names
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
                    key: _Prefetcher(
                        epoch_iterator, self.teacher_client, self.distill, self._student(), column
                    )
                }
            epoch_iterator = self._prefetchers[key]
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _student(self) -> torch.nn.Module:
        if self.model is None:
            raise ValueError("model: the Trainer has no model to compute the candidates with")
        return self.model

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
        if TEACHER_KEY not in inputs and self.teacher_client is not None:
            # Not prefetched (evaluation, prediction): fetch this batch's payload now.
            batch = _score_batch(inputs, teachers, self.distill, model)
            payload = self.teacher_client.score(
                batch.sequences,
                self.distill.request,
                attention_mask=batch.attention_mask,
                teacher=teachers,
                candidate_ids=batch.candidate_ids,
            )
            inputs = {**inputs, TEACHER_KEY: payload.to(inputs["input_ids"].device)}
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
