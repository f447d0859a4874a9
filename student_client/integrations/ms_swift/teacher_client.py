"""The teacher client ms-swift calls, answered by a topk-distill teacher over gRPC.

ms-swift's distillation asks each teacher through one method,
``client.infer(requests, request_config=RequestConfig(prompt_logprobs=K, max_tokens=1,
temperature=0.0), use_tqdm=False)``, and reads ``response.prompt_logprobs`` with
``parse_prompt_logprobs`` (``RolloutTrainerMixin._infer_teacher_requests``, ms-swift
4.6.0). Its own client (``VLLMInferClient``) posts the chat requests as JSON to a swift
server, which renders them with its chat template and runs vLLM. This one renders them
in the trainer, with the trainer's own template in the mode swift's vLLM engine encodes
in (``"vllm"``: ``template.encode(request)``, the response given as token ids kept as
they are), sends the token ids to the teacher over the binary gRPC stream
(:class:`~student_client.clients.blocking.TeacherClient`: float32 on the wire, retries
and fail-over between targets) and hands swift vLLM's entries
(:mod:`topk_protocol.swift_layout`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Unpack

import numpy as np

from student_client.clients.blocking import TeacherClient
from student_client.clients.client_options import ClientOptions
from topk_protocol.errors import InvalidRequestError, TeacherError
from topk_protocol.info import TeacherInfo, tokenizer_fingerprint
from topk_protocol.prompt_logprobs import payload_top_k
from topk_protocol.swift_layout import PromptLogprobs, prompt_logprobs

__all__ = ["PromptLogprobsResponse", "SwiftTeacherClient"]

#: The request fields of swift's ``InferRequest`` a teacher of token ids cannot serve.
_MULTI_MODAL = ("images", "videos", "audios")


@dataclass(frozen=True)
class PromptLogprobsResponse:
    """What swift's teacher path reads of a response: ``prompt_logprobs`` (``[L]``
    entries, :data:`~topk_protocol.swift_layout.PromptLogprobs`), with the ``L`` token
    ids they are about."""

    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs


class SwiftTeacherClient:
    """Stands in for ms-swift's ``VLLMInferClient`` as a teacher (``infer`` only).

    Args:
        target: the teacher's gRPC target(s), as for
            :class:`~student_client.clients.blocking.TeacherClient`.
        template: the trainer's swift ``Template`` (or :meth:`bind_template` later): the
            requests are rendered with it, as swift's server renders them.
        **options: the gRPC client's options (``token``, ``tls``, ``timeout_s``,
            ``retries``, ``expect_tokenizer_fingerprint``, ...).

    The log-probs travel as float32 (swift's server hands over vLLM's float32 values);
    the teacher must serve temperature 1: vLLM's prompt log-probs are the model's own,
    whatever ``temperature`` the request names.
    """

    def __init__(
        self, target: str | Sequence[str], template: Any = None, **options: Unpack[ClientOptions]
    ) -> None:
        self.target = target
        self.options: dict[str, Any] = {"expect_temperature": 1.0, **options}
        self._template: Any = None
        self._client: TeacherClient | None = None
        if template is not None:
            self.bind_template(template)

    def bind_template(self, template: Any) -> None:
        """Render with ``template`` from now on: a shallow copy of it in swift's ``"vllm"``
        mode (the trainer's own stays in its mode)."""
        view = copy.copy(template)
        view.set_mode("vllm")
        self._template = view

    @property
    def client(self) -> TeacherClient:
        """The gRPC client, made on first use."""
        if self._client is None:
            self._client = TeacherClient(self.target, **self.options)
        return self._client

    def encode(self, request: Any) -> list[int]:
        """The token ids swift's server would score for ``request`` (a swift
        ``InferRequest`` or its dict). Raises :class:`InvalidRequestError` naming the
        field for multi-modal inputs, ``RuntimeError`` before :meth:`bind_template`."""
        fields = (
            asdict(request)
            if is_dataclass(request) and not isinstance(request, type)
            else dict(request)
        )
        for name in _MULTI_MODAL:
            if fields.get(name):
                raise InvalidRequestError(
                    f"infer_requests[].{name}: a topk-distill teacher scores token ids "
                    "only; multi-modal teachers are served by swift's own teacher server"
                )
        if self._template is None:
            raise RuntimeError(
                "SwiftTeacherClient: no template bound (the plugin binds the trainer's)"
            )
        return list(self._template.encode(fields)["input_ids"])

    def infer(
        self,
        infer_requests: Sequence[Any],
        request_config: Any = None,
        metrics: Any = None,
        *,
        use_tqdm: bool | None = None,
        adapter_request: Any = None,
    ) -> list[PromptLogprobsResponse]:
        """swift's teacher call: each request rendered, scored in one batch, and answered
        with its prompt log-probs (K: ``request_config.prompt_logprobs``, 0 for the actual
        token only). ``metrics``, ``use_tqdm`` and ``adapter_request`` are accepted as
        swift passes them and not used."""
        num_logprobs = _prompt_logprobs(request_config)
        if not infer_requests:
            return []
        sequences = [np.asarray(self.encode(r), dtype=np.int32) for r in infer_requests]
        payload = self.client.score(
            sequences, payload_top_k(num_logprobs), dtype="float32", include_sampled=True
        )
        assert payload.sampled_logprobs is not None  # asked for: include_sampled
        out = []
        for b, tokens in enumerate(sequences):
            n = len(tokens)
            rows = prompt_logprobs(
                tokens,
                payload.ids[b, :n].numpy(),
                payload.logprobs[b, :n].numpy(),
                payload.sampled_logprobs[b, :n].numpy(),
                num_logprobs,
            )
            out.append(PromptLogprobsResponse(tokens.tolist(), rows))
        return out

    def check(self, tokenizer: Any, top_k: int, setting: str) -> TeacherInfo:
        """The teacher answers, tokenizes as ``tokenizer`` (the student's) does, serves
        temperature 1 and ``top_k``; its announced info. Raises ``ValueError`` naming
        ``setting`` (where the URL came from) or, for ``top_k``, ``--gkd_logits_topk``."""
        probe = TeacherClient(
            self.target,
            **{**self.options, "expect_tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)},
        )
        try:
            info = probe.info()
        except TeacherError as exc:
            raise ValueError(f"{setting}: the teacher at {self.target}: {exc}") from exc
        finally:
            probe.close()
        if top_k > info.max_top_k:
            raise ValueError(
                f"--gkd_logits_topk: {top_k}, but the teacher at {self.target} ({setting}) "
                f"serves at most {info.max_top_k}"
            )
        return info

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _prompt_logprobs(request_config: Any) -> int:
    """``prompt_logprobs`` of swift's ``RequestConfig`` (or its dict); a teacher call
    without it is refused naming the field."""
    if isinstance(request_config, Mapping):
        value = request_config.get("prompt_logprobs")
    else:
        value = getattr(request_config, "prompt_logprobs", None)
    if value is None:
        raise InvalidRequestError(
            "request_config.prompt_logprobs: a topk-distill teacher answers prompt "
            "log-probs only; give 0 (the actual token) or the top-k"
        )
    payload_top_k(value)  # checks it
    return int(value)
