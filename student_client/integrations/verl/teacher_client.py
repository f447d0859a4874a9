"""The teacher client verl calls, answered by a topk-distill teacher over gRPC.

verl's distillation asks each teacher through one method,
``await client.generate(request_id, prompt_ids=..., sampling_params=..., ...)``, and reads
``prompt_ids`` and ``prompt_logprobs`` from the returned ``TokenOutput.extra_fields``
(``AsyncTeacherLLMServerManager.compute_teacher_logprobs_single``, verl 0.9.1). Its own
client sends that call to a vLLM replica by Ray actor RPC, and the replica turns vLLM's
per-entry Python dictionaries of prompt log-probs into nested lists. This one sends the
sequence to the teacher over the binary gRPC stream (:class:`AsyncTeacherClient`:
little-endian arrays, float32 on the wire, retries and fail-over between targets) and
hands verl numpy arrays in its layout (:mod:`topk_protocol.verl_layout`), which verl's
``torch.tensor`` reads without a Python loop.

It pickles as its target and options (verl ships the clients to its agent-loop workers,
Ray actors): the gRPC channel is opened on first use inside the worker's event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack

import numpy as np

from student_client.clients.aio import AsyncTeacherClient
from student_client.clients.client_options import ClientOptions
from topk_protocol.errors import InvalidRequestError
from topk_protocol.prompt_logprobs import payload_top_k
from topk_protocol.verl_layout import verl_rows

__all__ = ["VerlTeacherClient"]

#: The inputs of verl's ``generate`` a teacher of token ids cannot serve.
_MULTI_MODAL = ("image_data", "video_data", "audio_data", "mm_processor_output")


class VerlTeacherClient:
    """Stands in for verl's ``LLMServerClient`` as a teacher (``generate`` only).

    Args:
        target: the teacher's gRPC target(s), as for :class:`AsyncTeacherClient`.
        **options: :class:`AsyncTeacherClient`'s options (``token``, ``tls``,
            ``timeout_s``, ``retries``, ``expect_tokenizer_fingerprint``, ...).

    The log-probs travel as float32 (verl's own path hands it the engine's float32
    values); the teacher must serve temperature 1, as verl's teacher path always asks.
    """

    def __init__(self, target: str | Sequence[str], **options: Unpack[ClientOptions]) -> None:
        self.target = target
        self.options: dict[str, Any] = {"expect_temperature": 1.0, **options}
        self._client: AsyncTeacherClient | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"target": self.target, "options": self.options, "_client": None}

    @property
    def client(self) -> AsyncTeacherClient:
        """The gRPC client, made on first use (in the running event loop)."""
        if self._client is None:
            self._client = AsyncTeacherClient(self.target, **self.options)
        return self._client

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: Sequence[int],
        sampling_params: dict[str, Any],
        **inputs: Any,
    ) -> Any:
        """verl's teacher call: a ``verl.workers.rollout.replica.TokenOutput`` whose
        ``extra_fields`` hold ``prompt_ids`` ``[L, max(K, 1)]`` int32 and
        ``prompt_logprobs`` ``[L, max(K, 1)]`` float32 for the ``L`` tokens of
        ``prompt_ids`` (K: ``sampling_params["prompt_logprobs"]``), and no generated
        token (verl's teacher path reads none). Multi-modal inputs raise
        :class:`~topk_protocol.errors.InvalidRequestError` naming the field."""
        from verl.workers.rollout.replica import TokenOutput

        for name in _MULTI_MODAL:
            if inputs.get(name):
                raise InvalidRequestError(
                    f"{name}: a topk-distill teacher scores token ids only; multi-modal "
                    "teachers are served by verl's own teacher path"
                )
        num_logprobs = sampling_params.get("prompt_logprobs") or 0
        tokens = np.asarray(prompt_ids, dtype=np.int32)
        payload = await self.client.score(
            [tokens], payload_top_k(num_logprobs), dtype="float32", include_sampled=True
        )
        assert payload.sampled_logprobs is not None  # asked for: include_sampled
        ids, logprobs = verl_rows(
            tokens,
            payload.ids[0].numpy(),
            payload.logprobs[0].numpy(),
            payload.sampled_logprobs[0].numpy(),
            num_logprobs,
        )
        return TokenOutput(
            token_ids=[], extra_fields={"prompt_ids": ids, "prompt_logprobs": logprobs}
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
