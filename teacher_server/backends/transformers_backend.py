"""transformers backend: the same payload from a plain forward pass.

The reference the vLLM backend is tested against, and a fallback for models vLLM cannot
load. Requests are served one at a time in a worker thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from teacher_server.backends.base import (
    Backend,
    BackendInfo,
    ScoredSequence,
    tokenizer_fingerprint,
    topk_from_logprobs,
)
from topk_protocol import check_temperature

__all__ = ["TransformersBackend"]


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
        max_top_k: int = 64,
        dtype: str = "float32",
        device: str = "cpu",
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        temperature: float = 1.0,
    ) -> None:
        self._temperature = check_temperature(temperature, "teacher_temperature")
        self._path = str(model)
        self._max_top_k = max_top_k
        self._dtype = dtype
        self._device = device
        self._served_name = served_model_name or Path(self._path).name
        self._max_model_len = max_model_len
        self._model: Any = None
        self._lock = threading.Lock()

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = getattr(torch, self._dtype) if self._dtype != "auto" else "auto"
        self._model = AutoModelForCausalLM.from_pretrained(self._path, dtype=dtype)
        self._model.to(self._device).eval()
        tok = AutoTokenizer.from_pretrained(self._path)
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
        )

    async def score(
        self, token_ids: npt.NDArray[np.int32], top_k: int, start: int, end: int
    ) -> ScoredSequence:
        cancelled = threading.Event()
        try:
            return await asyncio.to_thread(self.score_sync, token_ids, top_k, start, end, cancelled)
        except asyncio.CancelledError:
            # The thread cannot be stopped; it skips the work if it has not started yet,
            # so that a drain does not wait for every queued forward pass.
            cancelled.set()
            raise

    def score_sync(
        self,
        token_ids: npt.NDArray[np.int32],
        top_k: int,
        start: int,
        end: int,
        cancelled: threading.Event | None = None,
    ) -> ScoredSequence:
        """Blocking version of :meth:`score`; does nothing once ``cancelled`` is set."""
        import torch

        t0 = time.perf_counter()
        with self._lock, torch.inference_mode():
            if cancelled is not None and cancelled.is_set():
                raise RuntimeError("transformers backend: the request was cancelled")
            x = torch.as_tensor(np.asarray(token_ids, dtype=np.int64), device=self._device)
            logits = self._model(input_ids=x[None, : max(end, 1)]).logits[0]
            tempered = torch.log_softmax(logits.float() / self._temperature, dim=-1)
            lp = tempered[start:end].cpu().numpy()
        full = topk_from_logprobs(lp, np.asarray(token_ids[start : end + 1]), top_k)
        sampled = full.sampled_logprobs
        if end < len(token_ids):
            # The last row of the slice has a following token inside the sequence.
            sampled[-1] = lp[-1, int(token_ids[end])]
        return ScoredSequence(full.ids, full.logprobs, sampled, start, time.perf_counter() - t0)
