"""The real teacher: vLLM backend in a subprocess (one per session, ``vllm_teacher``, on
the array log-prob path), checked over loopback gRPC/HTTP against the transformers forward
pass on the same weights; at the end, a second server forced onto the ``flat_logprobs``
fallback (simulated vLLM version mismatch) against the first and the reference."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import ServerProcess, start_server
from engine_drift import FLOAT32_DRIFT, assert_same_topk, unambiguous_ranks
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from devtools.tiny_model import TINY_SERVE_ARGS
from teacher_server.validation import ParsedSequence
from topk_protocol import (
    RequestOptions,
    SequenceArrays,
    build_request,
    decode_sequence,
    encode_token_ids,
    pb,
    pb_grpc,
)

pytestmark = pytest.mark.vllm

TOL = FLOAT32_DRIFT


@pytest.fixture(scope="module")
def channel(vllm_teacher) -> Iterator[grpc.Channel]:  # type: ignore[no-untyped-def]
    opts = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    with grpc.insecure_channel(vllm_teacher.target, options=opts) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.TeacherStub:
    return pb_grpc.TeacherStub(channel)


def _sequences(seed: int, lengths: list[int], vocab: int = 512) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).astype(np.int32) for n in lengths]


def _request(
    seqs: list[np.ndarray],
    k: int,
    dtype: int = pb.LOGPROB_DTYPE_FLOAT32,
    ranges: list[tuple[int, int] | None] | None = None,
    request_id: str = "t",
) -> pb.ScoreRequest:
    req = pb.ScoreRequest(request_id=request_id, top_k=k, dtype=dtype)  # type: ignore[arg-type]
    for i, s in enumerate(seqs):
        sr = req.sequences.add(token_ids=encode_token_ids(s))
        if ranges and ranges[i] is not None:
            sr.position_start, sr.position_end = ranges[i]  # type: ignore[misc]
    return req


def _check_against_reference(got: SequenceArrays, ref: SequenceArrays, tol: float = TOL) -> None:
    """Log-probs within ``tol`` (float32); ids wherever the rank is unambiguous at that
    drift (:mod:`engine_drift`). ``ref``: the reference at ``K + 1``, so that the last
    column's ids are compared too."""
    ref_ids, ref_lp = ref.ids, ref.logprobs
    assert ref_ids.shape == (got.ids.shape[0], got.ids.shape[1] + 1)
    assert_same_topk(got.ids, got.logprobs, ref_ids, ref_lp, tol)


def _reference(backend, seq: np.ndarray, k: int, lo: int = 0, hi: int | None = None):  # type: ignore[no-untyped-def]
    """The transformers reference for positions ``[lo, hi)`` of ``seq``, at ``K + 1``."""
    end = len(seq) if hi is None else hi
    return backend.score_sync(ParsedSequence(seq, lo, end), RequestOptions(k + 1))


def test_get_info(stub: pb_grpc.TeacherStub, reference_backend) -> None:  # type: ignore[no-untyped-def]
    info = stub.GetInfo(pb.GetInfoRequest())
    assert info.vocab_size == 512
    assert info.max_top_k == 256
    assert info.backend == "vllm"
    assert info.schema_version == pb.SCHEMA_VERSION_1
    assert info.tokenizer_fingerprint == reference_backend.info.tokenizer_fingerprint
    assert set(info.supported_dtypes) == {1, 2, 3}


def test_startup_log_names_what_is_served(vllm_teacher, stub) -> None:  # type: ignore[no-untyped-def]
    """The "teacher ready" line states the limits GetInfo announces (``--max-candidates``
    caps the engine's vocabulary-wide capability)."""
    info = stub.GetInfo(pb.GetInfoRequest())
    (line,) = [x for x in vllm_teacher.log().splitlines() if "teacher ready:" in x]
    assert 0 < info.max_candidates < info.vocab_size
    assert f"max_candidates={info.max_candidates}," in line, line
    assert f"max_top_k={info.max_top_k}," in line, line


@pytest.mark.parametrize("k", [1, 8, 64])
def test_matches_transformers_reference(stub, reference_backend, k: int) -> None:  # type: ignore[no-untyped-def]
    seqs = _sequences(k, [1, 2, 47, 300, 1000])
    resp = stub.Score(_request(seqs, k))
    assert resp.final and len(resp.sequences) == len(seqs)
    for i, (seq, payload) in enumerate(zip(seqs, resp.sequences, strict=True)):
        got = decode_sequence(payload)
        assert payload.sequence_index == i and got.position_start == 0
        ref = _reference(reference_backend, seq, k)
        _check_against_reference(got, ref)
        assert got.sampled_logprobs is not None
        np.testing.assert_allclose(got.sampled_logprobs[:-1], ref.sampled_logprobs[:-1], atol=TOL)


def test_alignment(stub, reference_backend) -> None:  # type: ignore[no-untyped-def]
    """Position t predicts x[t+1]: the sampled log-prob at t is the reference's log-prob of
    x[t+1]; where x[t+1] is in the top-k it equals that entry; the last position has NaN
    sampled log-prob but a full top-k (the next token after the sequence)."""
    import torch

    (seq,) = _sequences(7, [64])
    got = decode_sequence(stub.Score(_request([seq], 256)).sequences[0])
    with torch.inference_mode():
        logits = reference_backend._model(input_ids=torch.as_tensor(seq[None]).long()).logits[0]
        dense = torch.log_softmax(logits.float(), -1).numpy()
    assert got.sampled_logprobs is not None
    np.testing.assert_allclose(got.sampled_logprobs[:-1], dense[np.arange(63), seq[1:]], atol=TOL)
    assert np.isnan(got.sampled_logprobs[-1])
    hits = 0
    for t in range(63):
        where = np.flatnonzero(got.ids[t] == seq[t + 1])
        if where.size:
            hits += 1
            assert abs(got.logprobs[t, where[0]] - got.sampled_logprobs[t]) < TOL
    assert hits > 10
    # The last row is the distribution after the whole sequence.
    np.testing.assert_allclose(got.logprobs[-1], np.sort(dense[-1])[::-1][:256], atol=TOL)
    assert np.all(np.diff(got.logprobs, axis=1) <= 0)


def test_sub_ranges(stub) -> None:  # type: ignore[no-untyped-def]
    seqs = _sequences(3, [50, 50, 50, 50])
    full = [decode_sequence(p) for p in stub.Score(_request(seqs, 8)).sequences]
    ranges: list[tuple[int, int] | None] = [(10, 20), (0, 1), (49, 50), (25, 25)]
    part = stub.Score(_request(seqs, 8, ranges=ranges)).sequences
    for (a, b), f, p in zip(ranges, full, part, strict=True):  # type: ignore[misc]
        d = decode_sequence(p)
        assert d.position_start == a and d.ids.shape == (b - a, 8)
        assert_same_topk(d.ids, d.logprobs, f.ids[a:b], f.logprobs[a:b], TOL)
        assert d.sampled_logprobs is not None and f.sampled_logprobs is not None
        np.testing.assert_allclose(d.sampled_logprobs, f.sampled_logprobs[a:b], atol=TOL)


@pytest.mark.parametrize(
    ("dtype", "atol"),
    [
        (pb.LOGPROB_DTYPE_FLOAT16, 1e-2),
        (pb.LOGPROB_DTYPE_BFLOAT16, 6e-2),
        (pb.LOGPROB_DTYPE_DEFAULT, 1e-2),
    ],
)
def test_dtypes(stub, dtype: int, atol: float) -> None:  # type: ignore[no-untyped-def]
    seqs = _sequences(11, [100])
    ref = decode_sequence(stub.Score(_request(seqs, 16)).sequences[0])
    payload = stub.Score(_request(seqs, 16, dtype=dtype)).sequences[0]
    want = pb.LOGPROB_DTYPE_FLOAT16 if dtype == pb.LOGPROB_DTYPE_DEFAULT else dtype
    assert payload.dtype == want
    assert len(payload.logprobs) == 100 * 16 * 2
    got = decode_sequence(payload)
    np.testing.assert_array_equal(got.ids, ref.ids)
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=atol, rtol=1e-2)


def test_sampled_logprobs_can_be_omitted(stub) -> None:  # type: ignore[no-untyped-def]
    req = _request(_sequences(1, [20]), 4)
    req.include_sampled_logprobs = False
    payload = stub.Score(req).sequences[0]
    assert payload.sampled_logprobs == b"" and decode_sequence(payload).sampled_logprobs is None


def test_score_stream_chunks_and_interleaves(stub) -> None:  # type: ignore[no-untyped-def]
    """A 4000-token sequence at K=256 is ~8 MB of payload: it comes back in row chunks under
    the 1 MiB chunk budget; several requests share the stream and are matched by id."""
    long_seq = _sequences(5, [4000])
    short = _sequences(6, [30, 5])
    reqs = [
        _request(long_seq, 256, request_id="long"),
        _request(short, 8, request_id="short"),
        _request(long_seq, 4, ranges=[(3990, 4000)], request_id="range"),
    ]
    msgs = list(stub.ScoreStream(iter(reqs)))
    by_id: dict[str, list[pb.ScoreResponse]] = {}
    for m in msgs:
        assert m.ByteSize() <= 1024 * 1024 + 4096
        assert not m.HasField("error")
        by_id.setdefault(m.request_id, []).append(m)
    assert set(by_id) == {"long", "short", "range"}
    for rid, parts in by_id.items():
        assert [m.final for m in parts] == [False] * (len(parts) - 1) + [True], rid
    assert len(by_id["long"]) >= 8
    chunks = [decode_sequence(p) for m in by_id["long"] for p in m.sequences]
    whole = SequenceArrays.concat(chunks)
    unary = stub.Score(_request(long_seq, 256), timeout=120)
    ref = decode_sequence(unary.sequences[0])
    np.testing.assert_array_equal(whole.ids, ref.ids)
    np.testing.assert_array_equal(whole.logprobs, ref.logprobs)
    tail = decode_sequence(by_id["range"][-1].sequences[0])
    assert tail.position_start == 3990
    np.testing.assert_array_equal(tail.ids, ref.ids[3990:, :4])


def test_concurrent_requests(channel: grpc.Channel) -> None:
    """Concurrent calls are batched by the engine and all answered correctly."""
    stub = pb_grpc.TeacherStub(channel)
    seqs = _sequences(9, [200] * 8)
    want = [decode_sequence(stub.Score(_request([s], 8)).sequences[0]) for s in seqs]
    futures = [stub.Score.future(_request([s], 8)) for s in seqs]
    for f, w in zip(futures, want, strict=True):
        got = decode_sequence(f.result().sequences[0])
        assert_same_topk(got.ids, got.logprobs, w.ids, w.logprobs, TOL)


def test_health_and_reflection(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "topk_distill.v1.Teacher"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = list(
        refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    )
    names = {s.name for s in answers[0].list_services_response.service}
    assert "topk_distill.v1.Teacher" in names and "grpc.health.v1.Health" in names


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return int(r.status), r.read()


def test_http_endpoints(vllm_teacher, stub) -> None:  # type: ignore[no-untyped-def]
    assert _get(f"{vllm_teacher.http}/healthz")[0] == 200
    assert _get(f"{vllm_teacher.http}/readyz") == (200, b'{"status":"ready"}')
    status, body = _get(f"{vllm_teacher.http}/v1/info")
    info = json.loads(body)
    assert status == 200 and info["vocab_size"] == 512 and info["backend"] == "vllm"
    assert info["max_top_k"] == 256

    def counter(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = _get(f"{vllm_teacher.http}/metrics")[1].decode()
    stub.Score(_request(_sequences(2, [10, 20]), 8, dtype=pb.LOGPROB_DTYPE_FLOAT16))
    after = _get(f"{vllm_teacher.http}/metrics")[1].decode()
    assert (
        counter(after, "topk_teacher_positions_scored_total")
        - counter(before, "topk_teacher_positions_scored_total")
        == 30
    )
    assert counter(after, "topk_teacher_payload_bytes_total") - counter(
        before, "topk_teacher_payload_bytes_total"
    ) == 30 * (8 * 6 + 2)
    assert counter(after, 'topk_teacher_requests_total{code="OK",method="Score"}') >= 1
    assert "topk_teacher_request_latency_seconds_bucket" in after
    assert "topk_teacher_requests_in_flight" in after


def test_expired_deadline_aborts_engine_work(vllm_teacher, stub) -> None:  # type: ignore[no-untyped-def]
    """A call whose deadline expires is cancelled on the server: its vLLM requests are
    aborted (the server log says so), nothing stays in flight, and serving goes on."""
    import time

    heavy = _request(_sequences(21, [4000] * 8), 256, request_id="heavy")
    aborted_before = vllm_teacher.log().count("aborted engine request")
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(heavy, timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        aborted = vllm_teacher.log().count("aborted engine request") - aborted_before
        metrics = _get(f"{vllm_teacher.http}/metrics")[1].decode()
        in_flight = [
            ln for ln in metrics.splitlines() if ln.startswith("topk_teacher_requests_in_flight ")
        ]
        if aborted >= 1 and in_flight == ["topk_teacher_requests_in_flight 0.0"]:
            break
        time.sleep(0.2)
    assert aborted >= 1, "no engine request was aborted"
    assert in_flight == ["topk_teacher_requests_in_flight 0.0"]
    assert 'topk_teacher_requests_total{code="CANCELLED",method="Score"}' in metrics
    assert stub.Score(_request(_sequences(22, [10]), 4), timeout=60).final


# -- the log-prob paths: the array path and the CPU top-k kernel (session server) vs the
# -- fallbacks, vLLM's flat_logprobs path and vLLM's own top-k (fallback server) -----------


def test_session_server_uses_the_array_path_and_picks_the_top_k_by_speed(vllm_teacher) -> None:  # type: ignore[no-untyped-def]
    log = vllm_teacher.log()
    assert "log-prob path: arrays" in log
    assert "fell back" not in log
    for hook in ("capped_scheduler", "engine_topk_kernel", "array_logprobs", "candidate_columns"):
        assert f"vLLM hook {hook} installed" in log, hook
    # auto installs the kernel (its self-check passed) and keeps the faster of the two,
    # saying which and the timings it picked by (which one wins is the CPU's business).
    picked = [ln for ln in log.splitlines() if "engine top-k: " in ln]
    assert len(picked) == 1, picked
    assert (
        "engine top-k: kernel (the kernel is faster: " in picked[0]
        or "engine top-k: vllm (vLLM's torch.topk is faster: the kernel takes " in picked[0]
    ), picked
    assert "us/row against vLLM's" in picked[0] and "V = 512, K = " in picked[0]


@pytest.fixture(scope="module")
def fallback_teacher(tiny_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:  # type: ignore[no-untyped-def]
    """A second vLLM server that believes vLLM is another version (a simulated mismatch),
    so it falls back to vLLM's flat_logprobs path and to vLLM's own top-k in the engine:
    vLLM's way end to end. The one extra engine of this suite."""
    from teacher_server.backends.vllm.hooks import SIMULATE_VERSION_ENV

    server = start_server(
        ["--backend", "vllm", "--model", str(tiny_model_dir), *TINY_SERVE_ARGS],
        tmp_path_factory.mktemp("vllm-fallback") / "server.log",
        env={SIMULATE_VERSION_ENV: "0.0.7"},
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fallback_stub(fallback_teacher: ServerProcess) -> Iterator[pb_grpc.TeacherStub]:
    opts = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    with grpc.insecure_channel(fallback_teacher.target, options=opts) as ch:
        yield pb_grpc.TeacherStub(ch)


@pytest.mark.parametrize(
    ("warning", "in_use"),
    [
        ("vLLM hook array_logprobs fell back", "log-prob path: flat"),
        ("vLLM hook engine_topk_kernel fell back", "engine top-k: vllm"),
        ("vLLM hook capped_scheduler fell back", "every position is computed"),
    ],
)
def test_fallback_warns_once_and_uses_vllms_way(
    fallback_teacher: ServerProcess, warning: str, in_use: str
) -> None:
    """Each hook falls back on its own, with one warning that names it and says why."""
    log = fallback_teacher.log()
    warnings = [ln for ln in log.splitlines() if warning in ln]
    assert len(warnings) == 1, warnings
    assert "WARNING" in warnings[0] and "vLLM 0.0.7 is not a version" in warnings[0]
    assert in_use in log


def test_fallback_refuses_candidate_ids_by_name(
    fallback_teacher: ServerProcess, fallback_stub: pb_grpc.TeacherStub
) -> None:
    """Candidates need the array path: on the flat one the teacher announces
    ``max_candidates`` 0, refuses them by name (INVALID_ARGUMENT), and goes on serving."""
    assert fallback_stub.GetInfo(pb.GetInfoRequest()).max_candidates == 0
    assert (
        "candidate ids are not scored nor payloads sampled (max_candidates and max_samples 0)"
        in fallback_teacher.log()
    )
    seq = _sequences(5, [6])
    req = build_request(seq, 4, candidate_ids=[np.zeros((6, 2), np.int32)])
    with pytest.raises(grpc.RpcError) as err:
        fallback_stub.Score(req, timeout=60)
    e: Any = err.value
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequences[0].candidate_ids: C = 2 candidates per position exceeds " in e.details()
    assert "max_candidates 0 (this teacher scores no candidates)" in e.details()
    assert len(fallback_stub.Score(build_request(seq, 4), timeout=60).sequences) == 1


#: Two engines' float32 log-probs of the same sequence: they may batch and chunk the
#: prefill differently (another order of operations), seen up to 2e-5 apart at 4000 tokens.
#: Bit-identity of the two paths on one engine's output: test_vllm_arrays.py and the
#: benchmark.
ENGINE_TOL = 5e-5


def _same_payloads(
    got: SequenceArrays,
    want: SequenceArrays,
    atol: float,
    clear: np.ndarray | None = None,
) -> None:
    """Two engines' payloads of one sequence: equal up to float rounding, ``atol`` per
    log-prob (ids where the rank is unambiguous at that drift, or where ``clear`` says)."""
    assert got.position_start == want.position_start and got.ids.shape == want.ids.shape
    assert_same_topk(got.ids, got.logprobs, want.ids, want.logprobs, atol, clear=clear)
    assert got.sampled_logprobs is not None and want.sampled_logprobs is not None
    np.testing.assert_allclose(got.sampled_logprobs, want.sampled_logprobs, atol=atol, rtol=0)


@pytest.mark.parametrize("k", [1, 8, 64])
def test_fallback_matches_array_path_and_reference(
    stub, fallback_stub, reference_backend, k: int
) -> None:  # type: ignore[no-untyped-def]
    """Ragged sequences, sub-ranges, K = 1 / 8 / 64, float32: the fallback server (flat
    path, vLLM's top-k) and the session server (array path, CPU top-k kernel) agree, and
    both match transformers."""
    seqs = _sequences(100 + k, [1, 2, 47, 300, 1000, 1000])
    ranges: list[tuple[int, int] | None] = [None, (1, 2), None, (10, 250), (999, 1000), (0, 1)]
    req = _request(seqs, k, ranges=ranges)
    arrays = [decode_sequence(p) for p in stub.Score(req).sequences]
    flat = [decode_sequence(p) for p in fallback_stub.Score(req).sequences]
    for seq, rng, a, f in zip(seqs, ranges, arrays, flat, strict=True):
        lo, hi = rng or (0, len(seq))
        _same_payloads(a, f, atol=ENGINE_TOL)
        ref = _reference(reference_backend, seq, k, lo, hi)
        for got in (a, f):
            assert got.position_start == lo
            _check_against_reference(got, ref)


@pytest.mark.parametrize("dtype", [pb.LOGPROB_DTYPE_FLOAT16, pb.LOGPROB_DTYPE_BFLOAT16])
def test_fallback_matches_array_path_in_every_dtype(stub, fallback_stub, dtype: int) -> None:  # type: ignore[no-untyped-def]
    """Log-probs within one unit in the last place of the wire dtype (values are within
    [-32, 0]); ids where their float32 log-probs (this engine's, asked at K + 1) are
    clearly apart: the wire dtype rounds the log-probs, not the ranks."""
    seqs = _sequences(12, [5, 200])
    exact = [decode_sequence(p) for p in stub.Score(_request(seqs, 17)).sequences]
    req = _request(seqs, 16, dtype=dtype)
    answers = zip(stub.Score(req).sequences, fallback_stub.Score(req).sequences, exact, strict=True)
    for a, f, e in answers:
        assert a.dtype == f.dtype == dtype
        clear = unambiguous_ranks(e.logprobs, 16, ENGINE_TOL)
        _same_payloads(decode_sequence(a), decode_sequence(f), atol=0.125, clear=clear)


def test_more_tokens_than_one_engine_step(stub, fallback_stub, reference_backend) -> None:  # type: ignore[no-untyped-def]
    """5 x 4000 tokens in one call exceed the engine's 16384-token step budget: vLLM spreads
    the prefill over several steps (chunking a sequence that does not fit whole), and both
    paths still match the reference (to 2e-4: float32 attention over 4000 tokens drifts a
    little further than over 1000; ids where the rank is unambiguous at that drift)."""
    seqs = _sequences(31, [4000] * 5)
    req = _request(seqs, 8)
    arrays = [decode_sequence(p) for p in stub.Score(req, timeout=300).sequences]
    flat = [decode_sequence(p) for p in fallback_stub.Score(req, timeout=300).sequences]
    for seq, a, f in zip(seqs, arrays, flat, strict=True):
        _same_payloads(a, f, atol=ENGINE_TOL)
        _check_against_reference(a, _reference(reference_backend, seq, 8), 2e-4)


def test_sampled_requests_are_refused_on_the_flat_path(
    fallback_stub: pb_grpc.TeacherStub,
) -> None:
    # Draws ride the array path's extra columns (vllm_sampling): on the flat fallback the
    # vLLM backend draws none, GetInfo says max_samples 0, a sampled request is refused
    # naming it, and the server keeps serving.
    stub = fallback_stub
    assert stub.GetInfo(pb.GetInfoRequest(), timeout=30).max_samples == 0
    seqs = _sequences(3, [12])
    with pytest.raises(grpc.RpcError) as e:
        stub.Score(build_request(seqs, 16, samples=16, seed=1), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "samples: 16, but this teacher serves no sampled payloads (max_samples 0)" in str(
        e.value.details()
    )
    assert len(stub.Score(build_request(seqs, 4), timeout=60).sequences) == 1
