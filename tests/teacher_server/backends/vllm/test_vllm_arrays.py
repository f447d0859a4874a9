"""The array log-prob path against vLLM's own ``flat_logprobs`` path and a dense reference,
on vLLM's real front-end classes (``OutputProcessor``, ``LogprobsProcessor``, its
``LogprobsTensors`` / ``LogprobsLists``) without starting an engine. The same comparisons
through real engines are in ``test_vllm_server.py``."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch
from vllm.logprobs import FlatLogprobs
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
from vllm.v1.outputs import LogprobsLists, LogprobsTensors

from teacher_server.backends.base import topk_from_logprobs
from teacher_server.backends.vllm import array_logprobs as va
from teacher_server.backends.vllm import hooks
from teacher_server.backends.vllm.backend import VLLMBackend
from teacher_server.backends.vllm.flat import flat_payload, flat_to_topk
from teacher_server.validation import ParsedSequence

V = 512


def _gather(dense: torch.Tensor, k: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """The rows vLLM's sampler makes (``Sampler.gather_logprobs``, written out here
    because vLLM's version is ``torch.compile``d): column 0 the given token, then
    ``torch.topk``; int32 ids, float32 log-probs."""
    top_lp, top_ids = torch.topk(dense, k, dim=-1)
    token_lp = dense.gather(-1, token_ids[:, None])
    return LogprobsTensors(
        torch.cat([token_ids[:, None], top_ids], 1).to(torch.int32),
        torch.cat([token_lp, top_lp], 1),
        (dense >= token_lp).sum(-1),  # the rank, counted as vLLM's batched_count_greater_than
    )


def _engine_outputs(
    x: np.ndarray, k: int, k_max: int, splits: list[int], seed: int
) -> tuple[np.ndarray, list[EngineCoreOutput]]:
    """What vLLM's engine core sends for ``x`` at K = ``k``: prompt log-prob rows made by
    the sampler's rule (:func:`_gather`), delivered in chunks cut at ``splits``, then the
    generated (greedy) token's row, ``k_max`` + 1 columns wide (the step's largest K).
    Returns the dense ``[L, V]`` log-probs too (row t predicts x[t+1])."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.log_softmax(torch.randn(len(x), V, generator=gen) * 3, -1)
    prompt = _gather(dense[:-1], k, torch.as_tensor(x[1:]).long())
    last = dense[-1:]
    sample = _gather(last, k_max, last.argmax(-1))
    outputs = []
    cuts = [0, *splits, len(x) - 1]
    for i, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        final = i == len(cuts) - 2
        outputs.append(
            EngineCoreOutput(
                request_id="r-0",
                new_token_ids=[int(last.argmax())] if final else [],
                new_logprobs=(LogprobsLists(*(t.numpy() for t in sample[:3])) if final else None),
                new_prompt_logprobs_tensors=LogprobsTensors(*(t[lo:hi] for t in prompt[:3])),
                finish_reason=FinishReason.LENGTH if final else None,
            )
        )
    return dense.numpy(), outputs


def _front_end(x: np.ndarray, k: int, outputs: list[EngineCoreOutput], arrays: bool):  # type: ignore[no-untyped-def]
    """Run vLLM's output processor (array hook attached) on ``outputs``; the final
    ``RequestOutput``."""
    op = OutputProcessor(tokenizer=None, log_stats=False)
    va.attach(op)
    params = VLLMBackend.sampling_params(k, arrays)  # what the backend sends
    req = EngineCoreRequest(
        request_id="r-0",
        prompt_token_ids=x.tolist(),
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id="r",
    )
    queue = RequestOutputCollector(params.output_kind, "r-0")
    op.add_request(req, None, None, 0, queue)
    for out in outputs:
        op.process_outputs([out])
    final = queue.get_nowait()
    assert final is not None and final.finished
    return final


@pytest.mark.parametrize(
    ("length", "k", "k_max", "splits", "ranges"),
    [
        (1, 8, 8, [], [(0, 1)]),
        (2, 1, 1, [], [(0, 2), (0, 1), (1, 2)]),
        (50, 8, 64, [], [(0, 50), (10, 20), (49, 50), (25, 25), (0, 1)]),
        (50, 64, 64, [7, 30], [(0, 50), (5, 40), (6, 8), (29, 31), (48, 50)]),
        (300, 1, 8, [1, 2, 299], [(0, 300), (0, 2), (298, 300)]),
    ],
)
def test_array_path_matches_flat_path_and_reference(
    length: int, k: int, k_max: int, splits: list[int], ranges: list[tuple[int, int]]
) -> None:
    """Bit-identical ids, log-probs, sampled log-probs and ranks to vLLM's flat path on
    the same engine output, for chunked prompts, generated-token rows wider than K + 1, sub-ranges
    and K = 1 / 8 / 64; and equal to the top-k of the dense log-probs."""
    x = np.random.default_rng(length + k).integers(0, V, length).astype(np.int32)
    dense, outputs = _engine_outputs(x, k, k_max, splits, seed=length * k)
    flat = _front_end(x, k, outputs, arrays=False)
    arr = _front_end(x, k, outputs, arrays=True)
    assert isinstance(flat.prompt_logprobs, FlatLogprobs)  # unmarked: vLLM's own path
    assert isinstance(arr.prompt_logprobs, va.LogprobArrays)
    assert len(arr.prompt_logprobs.chunks) == len(splits) + 1
    ref = topk_from_logprobs(dense, x, k)
    for a, b in ranges:
        got = va.payload_from_output(arr, k, ParsedSequence(x, a, b))
        want = flat_payload(flat, x, k, a, b)
        assert got.position_start == want.position_start == a and len(got) == b - a
        assert got.sampled_logprobs is not None and want.sampled_logprobs is not None
        assert ref.sampled_logprobs is not None
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        np.testing.assert_array_equal(got.sampled_logprobs, want.sampled_logprobs)  # NaN at L-1
        np.testing.assert_array_equal(got.ids, ref.ids[a:b])
        np.testing.assert_array_equal(got.logprobs, ref.logprobs[a:b])
        np.testing.assert_array_equal(got.sampled_logprobs, ref.sampled_logprobs[a:b])
        assert got.sampled_ranks is not None and ref.sampled_ranks is not None
        np.testing.assert_array_equal(got.sampled_ranks, want.sampled_ranks)  # 0 at L-1
        np.testing.assert_array_equal(got.sampled_ranks, ref.sampled_ranks[a:b])


def test_unsorted_and_tied_rows_are_sorted_like_the_flat_path() -> None:
    """Rows that do not come sorted (or with ties) give what the flat path gives."""
    rng = np.random.default_rng(3)
    k, rows = 6, 40
    ids = rng.integers(0, V, (rows, k + 1)).astype(np.int32)
    lps = -rng.integers(0, 4, (rows, k + 1)).astype(np.float32)  # many ties, unsorted
    sample_ids = rng.integers(0, V, (1, k + 3)).astype(np.int32)
    sample_lps = -rng.random((1, k + 3)).astype(np.float32)
    ranks = rng.integers(1, V, rows).astype(np.int32)
    prompt = [(ids, lps, ranks)]
    got = va.topk_payload(prompt, [(sample_ids, sample_lps, np.ones(1))], rows + 1, k, 0, rows + 1)
    cnt = k + 1
    flat_ids = np.concatenate([ids.ravel(), sample_ids[0, :cnt]]).tolist()
    flat_lps = np.concatenate([lps.ravel(), sample_lps[0, :cnt]]).tolist()
    flat_ranks = np.repeat(np.append(ranks, 1), cnt).tolist()  # vLLM's: the first entry's
    starts = list(range(0, (rows + 1) * cnt, cnt))
    ends = [s + cnt for s in starts]
    want = flat_to_topk(flat_ids, flat_lps, starts, ends, k, ranks=flat_ranks)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    assert got.sampled_logprobs is not None and want.sampled_logprobs is not None
    np.testing.assert_array_equal(got.sampled_logprobs[:-1], want.sampled_logprobs[:-1])
    assert got.sampled_ranks is not None and want.sampled_ranks is not None
    np.testing.assert_array_equal(got.sampled_ranks[:-1], want.sampled_ranks[:-1])
    np.testing.assert_array_equal(got.sampled_ranks[:-1], ranks)
    assert got.sampled_ranks[-1] == 0  # no next token
    assert np.all(np.diff(got.logprobs, axis=1) <= 0)


def test_malformed_rows_are_refused() -> None:
    ids = np.zeros((4, 3), np.int32)
    lps = np.zeros((4, 3), np.float32)
    ranks = np.ones(4, np.int32)
    with pytest.raises(RuntimeError, match=r"expected \[rows, >= 5\] for K = 4"):
        va.topk_payload([(ids, lps, ranks)], [], 5, 4, 0, 4)
    with pytest.raises(RuntimeError, match="4 prompt log-prob rows; expected 9"):
        va.topk_payload([(ids, lps, ranks)], [], 10, 2, 0, 4)
    with pytest.raises(RuntimeError, match="no log-probs for the generated token"):
        va.topk_payload([(ids, lps, ranks)], [], 5, 2, 0, 5)


def test_hook_check_and_path_selection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The installed vLLM passes the start-up check; a simulated other version makes
    ``auto`` fall back with one warning; ``arrays`` on an engine without the hook point
    fails at start-up with the reason; ``flat`` never touches the hook."""
    assert va.hook_problem() is None
    monkeypatch.setenv(hooks.SIMULATE_VERSION_ENV, "0.99.1")
    problem = va.hook_problem()
    assert problem is not None and "vLLM 0.99.1 is not a version it was written for" in problem
    assert va.hook_problem(check_version=False) is None
    with caplog.at_level(logging.WARNING, logger=hooks.__name__):
        assert va.select_path("auto", object()) == "flat"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "vLLM hook array_logprobs fell back: vLLM 0.99.1 is not" in warnings[0].message
    assert "in use instead: vLLM's flat_logprobs path" in warnings[0].message
    with pytest.raises(RuntimeError, match="no output_processor"):
        va.select_path("arrays", object())
    assert va.select_path("flat", object()) == "flat"
    with pytest.raises(ValueError, match="logprobs_path: 'fast' is not one of auto, arrays"):
        va.select_path("fast", object())
