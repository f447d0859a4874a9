"""transformers backend: the same payload from a plain forward pass.

The reference the vLLM backend is tested against, and a fallback for models vLLM cannot
load. Requests are served one at a time in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from teacher_server.backends.base import (
    Backend,
    BackendInfo,
    ModelFlags,
    gather_candidates,
    sampled_from_logprobs,
    topk_from_logprobs,
)
from teacher_server.backends.cpu_dtype import CpuDtype, cpu_dtype_for
from teacher_server.config import ServerConfig
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions, SequenceArrays, check_temperature
from topk_protocol.checks import MAX_SAMPLES
from topk_protocol.info import tokenizer_fingerprint

__all__ = ["TransformersBackend"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransformersFlags(ModelFlags):
    """The transformers backend's flags."""

    dtype: str = "float32"
    """torch dtype of the weights (auto: the checkpoint's; on a CPU without native bf16,
    float32)"""
    device: str = "cpu"
    """torch device"""
    max_model_len: int | None = None
    """longest sequence + 1 (default: the model's max_position_embeddings)"""


class TransformersBackend(Backend):
    """``AutoModelForCausalLM`` forward pass, float32 ``log_softmax(logits / T)``, top-k.

    Args:
        model: model directory.
        max_top_k: largest K served.
        dtype: torch dtype name for the weights (``float32`` by default).
        device: torch device.
        temperature: teacher temperature ``T``.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        max_top_k: int = ServerConfig.max_top_k,
        dtype: str = TransformersFlags.dtype,
        device: str = TransformersFlags.device,
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        temperature: float = TransformersFlags.teacher_temperature,
    ) -> None:
        self._temperature = check_temperature(temperature, "teacher_temperature")
        self._path = str(model)
        self._max_top_k = max_top_k
        self._dtype = dtype
        self._device = device
        self._served_name = served_model_name or Path(self._path).name
        self._max_model_len = max_model_len
        self._model: Any = None
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    Flags = TransformersFlags

    @classmethod
    def from_flags(cls, flags: TransformersFlags, *, max_top_k: int) -> TransformersBackend:
        return cls(
            flags.model,
            max_top_k=max_top_k,
            dtype=flags.dtype,
            device=flags.device,
            served_model_name=flags.served_model_name,
            max_model_len=flags.max_model_len,
            temperature=flags.teacher_temperature,
        )

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        choice = self._choose_dtype()
        dtype = getattr(torch, choice.dtype) if choice.dtype != "auto" else "auto"
        self._model = AutoModelForCausalLM.from_pretrained(self._path, dtype=dtype)
        self._model.to(self._device).eval()
        tok = AutoTokenizer.from_pretrained(self._path)
        self._tokenizer = tok
        cfg = self._model.config
        limit = self._max_model_len or int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self.info = BackendInfo(
            model_name=self._served_name,
            vocab_size=int(cfg.vocab_size),
            tokenizer_fingerprint=tokenizer_fingerprint(tok),
            max_top_k=self._max_top_k,
            max_sequence_length=max(limit - 1, 0) if limit else 0,
            name="transformers",
            dtype=str(self._model.dtype).removeprefix("torch."),
            temperature=self._temperature,
            max_candidates=int(cfg.vocab_size),  # any C: one gather of the dense rows
            max_samples=MAX_SAMPLES,
        )
        log.info("transformers model computes in %s (%s)", self.info.dtype, choice.reason)

    def _choose_dtype(self) -> CpuDtype:
        """``--dtype`` as given, or on CPU by the rule of ``cpu_dtype`` (``auto`` is
        float32 where bf16 is emulated; a warning for an emulated dtype given explicitly)."""
        import torch

        if torch.device(self._device).type != "cpu":
            return CpuDtype(self._dtype, f"--dtype {self._dtype}")
        choice = cpu_dtype_for(self._dtype, self._path)
        if choice.warn:
            log.warning("%s", choice.reason)
        return choice

    @property
    def tokenizer(self) -> Any | None:
        """The model's tokenizer (None before start)."""
        return self._tokenizer

    async def score(self, sequence: ParsedSequence, options: RequestOptions) -> SequenceArrays:
        cancelled = threading.Event()
        try:
            return await asyncio.to_thread(self.score_sync, sequence, options, cancelled)
        except asyncio.CancelledError:
            # The thread cannot be stopped; it skips the work if it has not started yet,
            # so that a drain does not wait for every queued forward pass.
            cancelled.set()
            raise

    def score_sync(
        self,
        sequence: ParsedSequence,
        options: RequestOptions,
        cancelled: threading.Event | None = None,
    ) -> SequenceArrays:
        """Blocking version of :meth:`score`; does nothing once ``cancelled`` is set."""
        import torch

        token_ids, start, end = sequence.token_ids, sequence.start, sequence.end
        with self._lock, torch.inference_mode():
            if cancelled is not None and cancelled.is_set():
                raise RuntimeError("transformers backend: the request was cancelled")
            x = torch.as_tensor(np.asarray(token_ids, dtype=np.int64), device=self._device)
            logits = self._model(input_ids=x[None, : max(end, 1)]).logits[0]
            tempered = torch.log_softmax(logits.float() / self._temperature, dim=-1)
            if options.sampled:
                return sampled_from_logprobs(tempered[start:end], token_ids, start, options)
            cand = sequence.candidate_ids
            cand_lp = (
                None
                if cand is None
                else gather_candidates(
                    tempered[start:end],
                    torch.from_numpy(cand.astype(np.int64)).to(tempered.device),
                )
                .cpu()
                .numpy()
            )
            lp = tempered[start:end].cpu().numpy()
        # token_ids[start : end + 1]: one more than the rows when the slice's last row
        # has a following token inside the sequence.
        full = topk_from_logprobs(lp, np.asarray(token_ids[start : end + 1]), options.top_k)
        return replace(
            full,
            position_start=start,
            candidate_ids=cand,
            candidate_logprobs=cand_lp,
        )
