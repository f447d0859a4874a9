"""The vLLM teacher's answer fingerprint: it agrees with the transformers reference on the
same float32 weights (another engine, same stated drift), and with the canaries scored
again while other requests are batched with them."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from devtools.launch import TeacherProcess
from student_client import TeacherClient
from teacher_server.answer_fingerprint import score_canaries
from topk_protocol.fingerprint import CANARY_TOP_K, AnswerFingerprint, canary_sequences, differences

pytestmark = pytest.mark.vllm


def test_vllm_agrees_with_transformers_and_under_batching_load(
    vllm_teacher: TeacherProcess, reference_backend: object
) -> None:
    with TeacherClient(vllm_teacher.target) as client:
        info = client.info()
    fp = info.answer_fingerprint
    assert fp is not None and fp.engine_dtype == "float32"
    reference = asyncio.run(score_canaries(reference_backend))  # type: ignore[arg-type]
    assert reference is not None
    assert differences(fp, reference) == []

    stop = threading.Event()
    rng = np.random.default_rng(0)
    noise = [[rng.integers(0, 256, size=n).tolist() for n in (300, 90, 17)] for _ in range(6)]

    def load() -> None:
        with TeacherClient(vllm_teacher.target) as c:
            while not stop.is_set():
                for _ in c.stream(noise, 16, depth=4):
                    pass

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        with TeacherClient(vllm_teacher.target) as client:
            canaries = [s.tolist() for s in canary_sequences(info.vocab_size)]
            # One request: the canaries batched with each other and with the load.
            payload = client.score(canaries, CANARY_TOP_K, dtype="float32")
    finally:
        stop.set()
        for t in threads:
            t.join()
    again = AnswerFingerprint(
        fp.canary,
        payload.ids.reshape(-1, CANARY_TOP_K).numpy().astype(np.int32),
        payload.logprobs.reshape(-1, CANARY_TOP_K).numpy(),
        fp.drift,
        fp.engine_dtype,
    )
    assert differences(again, fp) == []
