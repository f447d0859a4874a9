"""TRL's ``AsyncDistillationTrainer`` against this teacher's HTTP port, with TRL's own
code (``trl/experimental/async_distillation/async_rollout_worker.py``, the installed
TRL): the rollout loop's ``_resolve_teacher_model_names`` (``GET /v1/models``) and
``_score_with_teacher`` (``POST /v1/completions`` with ``model``, the prompt and the
completion as one token prompt, ``max_tokens: 1``, ``temperature`` and
``prompt_logprobs`` K), whose answer it parses with ``_parse_teacher_logprobs_at_position``
(each completion position's entries sorted by ``rank``). Compared with the dense
transformers reference within 2e-4: the top-K by rank, then the realized token where it
is outside the top-K, each with its log-prob."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from dense_reference import dense_logprobs

from tests.conftest import ServerProcess

pytestmark = pytest.mark.vllm

TOL = 2e-4
VOCAB = 512
K = 8


async def _score(url: str, prompts: list[tuple[list[int], list[int]]]) -> tuple[str, list[Any]]:
    """TRL's rollout loop, holding what its ``__init__`` and ``_run_loops`` set for these
    two calls, scoring each (prompt, completion)."""
    import aiohttp
    from accelerate import PartialState
    from trl.experimental.async_distillation import async_rollout_worker as worker

    PartialState()  # TRL logs through accelerate, whose state its trainer process sets up

    loop = worker._AsyncRolloutLoop.__new__(worker._AsyncRolloutLoop)
    loop.teacher_server_urls = {"default": url}
    loop.teacher_model_names = {}
    loop.teacher_top_k = K
    loop.teacher_temperature = 1.0
    loop.request_timeout = 120
    loop._counters = defaultdict(float)
    async with aiohttp.ClientSession() as session:
        loop.session = session
        await loop._resolve_teacher_model_names()
        name = loop.teacher_model_names["default"]
        scored = [await loop._score_with_teacher(p, c, url, name) for p, c in prompts]
    return name, scored


def test_score_with_teacher_against_the_dense_reference(
    vllm_teacher: ServerProcess, reference_backend: Any
) -> None:
    rng = np.random.default_rng(62)
    prompts = [
        (rng.integers(0, VOCAB, p).tolist(), rng.integers(0, VOCAB, c).tolist())
        for p, c in ((1, 1), (1, 30), (17, 40))
    ]
    name, scored = asyncio.run(_score(vllm_teacher.http, prompts))
    assert name
    outside = 0
    for (prompt, completion), (ids, lps) in zip(prompts, scored, strict=True):
        seq = prompt + completion
        dense = dense_logprobs(reference_backend, seq)
        assert len(ids) == len(lps) == len(completion)
        for j, position in enumerate(range(len(prompt), len(seq))):
            row = dense[position - 1]
            realized = seq[position]
            top = np.argsort(-row, kind="stable")[:K]
            np.testing.assert_allclose(lps[j], row[ids[j]], rtol=0, atol=TOL)
            np.testing.assert_allclose(lps[j][:K], row[top], rtol=0, atol=TOL)
            if realized in top:
                assert len(ids[j]) == K
            else:
                outside += 1
                assert len(ids[j]) == K + 1 and ids[j][K] == realized
    assert outside > 0  # K = 8 of 512 ids: most realized tokens fall outside
