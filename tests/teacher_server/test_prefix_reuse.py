"""Prefix reuse on the live vLLM teacher is exact: payloads served with vLLM's prefix cache
read up to each request's first position equal those of a server with reuse off.

Two real servers of their own on the tiny model: one with reuse off
(``--no-enable-prefix-caching``: the reference) and one with reuse on and a KV cache of 16
blocks, small enough that the groups of one run evict each other (the session's shared
server, reuse on with a large cache, serves every other vLLM test's sub-ranges). The
same requests go to a reuse server in two orders (vLLM #42019: prompt log-probs under
prefix caching depended on the order), as one request of G sequences or as G concurrent
requests, over prompt and completion lengths at block boundaries and one token either
side, sub-ranges, top-k, candidate, packed and sampled payloads (hypothesis,
derandomized); a group sent as requests for every position shares its prompt's rows.
Equal means: log-probs within ``FLOAT32_DRIFT`` and ids equal where the
rank is unambiguous (``engine_drift``); draws identical.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import ServerProcess, start_server
from engine_drift import FLOAT32_DRIFT, assert_same_topk, unambiguous_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from topk_protocol import SequenceArrays, build_request, decode_sequence, pb, pb_grpc
from topk_protocol.packing import error_bound

pytestmark = pytest.mark.vllm

VOCAB, BLOCK = 512, 128  # the tiny model's vocabulary; vLLM's CPU block size
#: KV cache of the evicting server: 16 blocks of 128 tokens.
SMALL_KV_BLOCKS = 16
SMALL_ARGS = [
    "--dtype", "float32", "--max-top-k", "256", "--max-model-len", "1024",
    "--max-num-batched-tokens", "2048", "--num-gpu-blocks-override", str(SMALL_KV_BLOCKS),
]  # fmt: skip
K, CANDIDATES, SAMPLES, SEED, BITS = 8, 3, 16, 77, 8
#: Engine start-up on a loaded 2-core machine can take minutes.
READY_S = 1800


@dataclass
class Teacher:
    server: ServerProcess
    stub: pb_grpc.TeacherStub

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.server.http}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        assert found, f"{name} not on /metrics"
        return float(found.group(1))


def _teacher(server: ServerProcess) -> Iterator[Teacher]:
    with grpc.insecure_channel(server.target) as ch:
        yield Teacher(server, pb_grpc.TeacherStub(ch))


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Teacher]:
    log = tmp_path_factory.mktemp("plain") / "server.log"
    server = start_server(
        ["--backend", "vllm", "--model", str(tiny_model_dir), *SMALL_ARGS[:-2],
         "--no-enable-prefix-caching"],
        log,
        ready_timeout_s=READY_S,
    )  # fmt: skip
    try:
        assert "prefix reuse off" in server.log()
        yield from _teacher(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reuse(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Teacher]:
    log = tmp_path_factory.mktemp("reuse") / "server.log"
    server = start_server(
        ["--backend", "vllm", "--model", str(tiny_model_dir), *SMALL_ARGS],
        log,
        ready_timeout_s=READY_S,
    )
    try:
        assert "prefix reuse on" in server.log()
        yield from _teacher(server)
    finally:
        server.stop()


def _group(seed: int, prompt: int, completion: int, g: int) -> list[np.ndarray]:
    """G sequences: one shared prompt, G different completions."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, VOCAB, prompt).astype(np.int32)
    return [np.concatenate([head, rng.integers(0, VOCAB, completion).astype(np.int32)])
            for _ in range(g)]  # fmt: skip


def _options(kind: str) -> dict[str, object]:
    if kind == "packed":
        return {"dtype": "float32", "encoding": "packed", "logprob_bits": BITS}
    if kind == "sampled":
        return {"dtype": "float32", "samples": SAMPLES, "seed": SEED}
    return {"dtype": "float32"}


def _candidates(seqs: list[np.ndarray], spans: list[tuple[int, int]]) -> list[np.ndarray]:
    """Candidate ids drawn from each sequence's own tokens: the same whatever the order."""
    out = []
    for seq, (a, b) in zip(seqs, spans, strict=True):
        rng = np.random.default_rng(seq.astype(np.int64).tolist())
        out.append(rng.integers(-1, VOCAB, (b - a, CANDIDATES)).astype(np.int32))
    return out


def _score(
    stub: pb_grpc.TeacherStub,
    seqs: list[np.ndarray],
    spans: list[tuple[int, int]],
    kind: str,
    *,
    concurrent: bool = False,
    k: int = K,
) -> list[SequenceArrays]:
    """The payloads of ``seqs`` (one request, or one request per sequence sent at once)."""
    cands = _candidates(seqs, spans) if kind == "candidates" else None
    top = SAMPLES if kind == "sampled" else k

    def request(idx: list[int]) -> pb.ScoreRequest:
        return build_request(
            [seqs[i] for i in idx],
            top,
            positions=[spans[i] for i in idx],
            candidate_ids=None if cands is None else [cands[i] for i in idx],
            **_options(kind),  # type: ignore[arg-type]
        )

    def decode(msgs: list[pb.SequencePayload], idx: list[int]) -> list[SequenceArrays]:
        return [
            decode_sequence(m, None if cands is None else cands[i])
            for m, i in zip(msgs, idx, strict=True)
        ]

    everything = list(range(len(seqs)))
    if not concurrent:
        return decode(list(stub.Score(request(everything), timeout=300).sequences), everything)
    with ThreadPoolExecutor(len(seqs)) as pool:
        answers = list(pool.map(lambda i: stub.Score(request([i]), timeout=300), everything))
    return [decode(list(a.sequences), [i])[0] for i, a in enumerate(answers)]


def _assert_equal(got: SequenceArrays, want: SequenceArrays, kind: str) -> None:
    assert got.position_start == want.position_start
    assert got.ids.shape == want.ids.shape
    if kind == "sampled":
        assert got.sample_counts is not None and want.sample_counts is not None
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_array_equal(got.sample_counts, want.sample_counts)
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=FLOAT32_DRIFT, rtol=0)
        return
    if kind == "packed":
        bound = error_bound(want.logprobs, BITS, "float32")[:, None]
        assert (np.abs(got.logprobs - want.logprobs) <= 2 * bound + FLOAT32_DRIFT).all()
        np.testing.assert_array_equal(got.ids, want.ids)  # unambiguous at this model's gaps
        return
    # Ids wherever the rank is unambiguous (a one-row answer may have few such ranks).
    clear = unambiguous_ranks(want.logprobs, want.ids.shape[1], FLOAT32_DRIFT, min_compared=0)
    assert_same_topk(got.ids, got.logprobs, want.ids, want.logprobs, FLOAT32_DRIFT, clear=clear)
    if want.sampled_logprobs is not None:
        assert got.sampled_logprobs is not None
        np.testing.assert_allclose(
            got.sampled_logprobs, want.sampled_logprobs, atol=FLOAT32_DRIFT, rtol=0
        )
    if kind == "candidates":
        assert got.candidate_logprobs is not None and want.candidate_logprobs is not None
        np.testing.assert_allclose(
            got.candidate_logprobs, want.candidate_logprobs, atol=FLOAT32_DRIFT, rtol=0
        )


#: Lengths at block boundaries and one token either side of them.
AROUND_BLOCKS = [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + 1]


@settings(max_examples=examples(14), deadline=None)
@given(
    prompt=st.sampled_from([5, *AROUND_BLOCKS]),
    completion=st.sampled_from([1, 2, BLOCK - 1, BLOCK, BLOCK + 1]),
    g=st.integers(1, 4),
    shift=st.sampled_from([0, -1, 1]),
    last=st.booleans(),
    kind=st.sampled_from(["topk", "topk", "candidates", "packed", "sampled"]),
    concurrent=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_reuse_equals_reuse_off_in_both_orders(
    reuse: Teacher,
    plain: Teacher,
    prompt: int,
    completion: int,
    g: int,
    shift: int,
    last: bool,
    kind: str,
    concurrent: bool,
    seed: int,
) -> None:
    seqs = _group(seed, prompt, completion, g)
    length = prompt + completion
    start = min(max(prompt + shift, 0), length - 1)  # positions from the prompt's end (+-1)
    end = length if last or start == length - 1 else length - 1
    spans = [(start, end)] * g
    want = _score(plain.stub, seqs, spans, kind)
    teacher = reuse
    before = teacher.metric("topk_teacher_engine_cached_tokens_total")
    order = np.random.default_rng(seed).permutation(g)
    for perm in (order, order[::-1]):  # the same requests in two orders
        got = _score(teacher.stub, [seqs[i] for i in perm], spans, kind, concurrent=concurrent)
        for i, payload in zip(perm, got, strict=True):
            _assert_equal(payload, want[i], kind)
    cached = teacher.metric("topk_teacher_engine_cached_tokens_total") - before
    # Each engine request reads at most the blocks before its own first position; per
    # sequence and order there are at most two: the prefix's forward pass (PrefixOrder)
    # and the scoring request, which starts at ``start`` or, once the first order has
    # answered the same sequence, at its last row (the rest shared: SharedRows).
    cap, cap_last = (start // BLOCK) * BLOCK, ((length - 1) // BLOCK) * BLOCK
    assert cached <= g * 2 * cap + g * (cap + max(cap, cap_last))


def _distinct_group(seed: int, prompt: int, completion: int, g: int) -> list[np.ndarray]:
    """:func:`_group` whose completions differ from their first token on."""
    seqs = _group(seed, prompt, completion, g)
    for i, seq in enumerate(seqs):
        seq[prompt] = i
    return seqs


def test_a_group_reads_its_prompt_once_from_any_first_position(
    reuse: Teacher, plain: Teacher
) -> None:
    """G = 4 completions of a 3-block prompt, sent at once, as one request for every
    position (slime's way) and as G requests from the prompt's end: the prompt is computed
    once either way, and the counters on /metrics say so.

    Every position: one sequence computes all its tokens; the others share its rows up to
    the prompt's last one and read its blocks up to there (two blocks: the third holds the
    prompt's last token, whose row the engine computes again). From the prompt's end: the
    prompt is a forward pass of its own, read by the 4 requests (PrefixOrder)."""
    prompt, completion, g = 3 * BLOCK, 40, 4
    length = prompt + completion
    names = [
        "topk_teacher_engine_cached_tokens_total",
        "topk_teacher_positions_computed_total",
        "topk_teacher_positions_answered_total",
    ]
    before = [reuse.metric(n) for n in names]
    full = _distinct_group(9001, prompt, completion, g)
    got = _score(reuse.stub, full, [(0, length)] * g, "topk")
    for payload, want in zip(got, _score(plain.stub, full, [(0, length)] * g, "topk"), strict=True):
        _assert_equal(payload, want, "topk")
    read = ((prompt - 1) // BLOCK) * BLOCK
    cached, computed, answered = (reuse.metric(n) - b for n, b in zip(names, before, strict=True))
    assert cached == (g - 1) * read
    assert computed == length + (g - 1) * (length - read)
    assert answered == g * length
    seqs = _distinct_group(9002, prompt, completion, g)
    _score(reuse.stub, seqs, [(prompt, length)] * g, "topk", concurrent=True)
    cached2, computed2, answered2 = (
        reuse.metric(n) - b for n, b in zip(names, before, strict=True)
    )
    assert cached2 - cached == g * prompt
    # The prompt once, then each completion.
    assert computed2 - computed == prompt + g * completion
    assert answered2 - answered == g * completion
    assert 0 < reuse.metric("topk_teacher_cached_token_ratio") < 1


def test_an_evicted_prompt_is_recomputed_exactly(reuse: Teacher, plain: Teacher) -> None:
    """A group's prompt pushed out of the 16-block cache by other prompts is computed
    again (no cached tokens), and the answer is still the reference's."""
    prompt, completion = 4 * BLOCK, 8
    first = _group(5, prompt, completion, 2)
    span = [(prompt, prompt + completion)]
    _score(reuse.stub, first[:1], span, "topk")
    for seed in range(6):  # 6 x 5 blocks through a 16-block cache
        _score(reuse.stub, _group(100 + seed, prompt, completion, 1), span, "topk")
    before = reuse.metric("topk_teacher_engine_cached_tokens_total")
    got = _score(reuse.stub, first[1:], span, "topk")
    assert reuse.metric("topk_teacher_engine_cached_tokens_total") == before  # evicted
    _assert_equal(got[0], _score(plain.stub, first[1:], span, "topk")[0], "topk")


def test_multi_turn_costs_only_the_new_tokens(reuse: Teacher, plain: Teacher) -> None:
    """A conversation scored after each turn: turn n reads turn n-1's blocks."""
    rng = np.random.default_rng(31)
    seq = rng.integers(0, VOCAB, 2 * BLOCK + 7).astype(np.int32)
    _score(reuse.stub, [seq], [(0, len(seq))], "topk")  # the first turn: every position
    for _turn in range(3):
        start = len(seq)
        seq = np.concatenate([seq, rng.integers(0, VOCAB, BLOCK + 3).astype(np.int32)])
        before = reuse.metric("topk_teacher_engine_cached_tokens_total")
        got = _score(reuse.stub, [seq], [(start, len(seq))], "topk")
        assert reuse.metric("topk_teacher_engine_cached_tokens_total") - before == (
            start // BLOCK * BLOCK
        )
        _assert_equal(got[0], _score(plain.stub, [seq], [(start, len(seq))], "topk")[0], "topk")


def test_positions_beyond_the_sequence_are_refused_and_the_server_keeps_serving(
    reuse: Teacher,
) -> None:
    seq = np.arange(300, dtype=np.int32) % VOCAB
    req = pb.ScoreRequest(top_k=4)
    req.sequences.add(token_ids=seq.astype("<i4").tobytes(), position_start=290, position_end=301)
    with pytest.raises(grpc.RpcError) as err:
        reuse.stub.Score(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequences[0].position_start/position_end" in str(err.value.details())
    ok = _score(reuse.stub, [seq], [(290, 300)], "topk")
    assert ok[0].ids.shape == (10, K)
