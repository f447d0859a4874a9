"""TRL's own teacher client (``trl.generation.vllm_client.VLLMClient``, the installed
release and TRL 1.10) against the session's vLLM teacher over HTTP: the rows equal our
gRPC payload of the same sequences shifted into TRL's alignment (row ``p`` = our row
``p - 1``; position 0 ``-inf``), and every refusal is a 4xx naming the field, after which
the server keeps serving. The expected answers are built here by plain indexing, not with
``topk_protocol.trl_layout``."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from pinned_clients import installed_apart, run_apart

from benchmarks.json_render_reference import as_float32
from student_client.clients.blocking import TeacherClient
from tests.conftest import ROOT, ServerProcess

pytestmark = pytest.mark.vllm

K = 64
LENGTHS = [1, 2, 47, 300]
KEYS = ("logprobs", "logprob_token_ids", "actual_logprobs", "actual_token_ids")
#: TRL 1.10 (its own ``/get_sequence_logprobs/``), installed beside the project's TRL.
TRL_110 = "1.10.0"
INF = math.inf


def _sequences() -> list[list[int]]:
    rng = np.random.default_rng(21)
    return [rng.integers(0, 512, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def trl_client(vllm_teacher: ServerProcess) -> Any:
    """TRL's ``VLLMClient`` (the installed release) on the teacher's HTTP port."""
    from trl.generation.vllm_client import VLLMClient

    return VLLMClient(base_url=vllm_teacher.http, connection_timeout=60)


@pytest.fixture(scope="module")
def grpc_rows(vllm_teacher: ServerProcess) -> dict[str, list[Any]]:
    """Our gRPC payload (float32, every row) of :func:`_sequences`, as lists."""
    with TeacherClient(vllm_teacher.target) as client:
        p = client.score(_sequences(), K, dtype="float32")
    assert p.sampled_logprobs is not None
    return {
        "ids": p.ids.tolist(),
        "logprobs": p.logprobs.tolist(),
        "sampled": p.sampled_logprobs.tolist(),
    }


def _expected(
    rows: dict[str, list[Any]], seqs: list[list[int]], prompt_lengths: list[int]
) -> dict[str, list[Any]]:
    """What TRL reads for TRL's alignment of our rows: TRL row p is our row p - 1."""
    out: dict[str, list[Any]] = {key: [] for key in KEYS}
    for b, (seq, start) in enumerate(zip(seqs, prompt_lengths, strict=True)):
        lps, ids, act, act_ids = [], [], [], []
        for p in range(start, len(seq)):
            if p == 0:  # no distribution for the first token
                lps.append([-INF] * K)
                ids.append([0] * K)
                act.append([-INF])
            else:
                lps.append(rows["logprobs"][b][p - 1])
                ids.append(rows["ids"][b][p - 1])
                act.append([rows["sampled"][b][p - 1]])
            act_ids.append([seq[p]])
        for key, value in zip(KEYS, (lps, ids, act, act_ids), strict=True):
            out[key].append(value)
    return out


@pytest.mark.parametrize("prompt_lengths", [[0, 0, 0, 0], [0, 1, 10, 300]])
def test_trl_client_reads_our_completions_route(
    trl_client: Any, grpc_rows: dict[str, list[Any]], prompt_lengths: list[int]
) -> None:
    """TRL 1.11+'s client (vLLM's ``/v1/completions``): full sequences and prompt-length
    sub-ranges, equal to our gRPC payload shifted, values exactly as float32 (the JSON
    holds each float32's shortest decimal, the gRPC payload the float32 itself)."""
    seqs = _sequences()
    got = trl_client.get_sequence_logprobs(seqs, prompt_lengths, top_logprobs=K)
    want = _expected(grpc_rows, seqs, prompt_lengths)
    assert [len(r) for r in got["logprobs"]] == [
        n - p for n, p in zip(LENGTHS, prompt_lengths, strict=True)
    ]
    for key in KEYS:
        assert as_float32(got[key]) == as_float32(want[key]), key
    # The actual token's log-prob is there also where it is outside the top K.
    outside = [
        act[0] != -INF and tok[0] not in ids
        for b in range(len(seqs))
        for ids, act, tok in zip(
            got["logprob_token_ids"][b],
            got["actual_logprobs"][b],
            got["actual_token_ids"][b],
            strict=True,
        )
    ]
    assert sum(outside) > len(outside) // 2  # K = 64 of 512 ids
    # Chunked dispatch (several requests at once) gives the same answer.
    chunked = trl_client.get_sequence_logprobs(seqs, prompt_lengths, top_logprobs=K, chunk_size=1)
    assert chunked == got


@pytest.fixture(scope="module")
def trl_110() -> Path:
    """TRL 1.10 installed (``pip --no-deps --target``, cached) beside the project's TRL;
    its client runs in a subprocess with it first on ``PYTHONPATH``."""
    return installed_apart(f"trl-{TRL_110}", [f"trl=={TRL_110}"], "trl/generation/vllm_client.py")


_CALL_110 = """
import json, sys
from trl.generation.vllm_client import VLLMClient
base_url, seqs, lengths, k, binary = json.loads(sys.argv[1])
client = VLLMClient(base_url=base_url)
assert VLLMClient.__module__ == "trl.generation.vllm_client"
import trl; print(trl.__version__, file=sys.stderr)
got = client.get_sequence_logprobs(seqs, lengths, top_logprobs=k, use_binary=binary)
print(json.dumps(got))
"""


def _run_110(trl_dir: Path, args: list[Any]) -> tuple[dict[str, Any], str]:
    got, log = run_apart(trl_dir, _CALL_110, args)
    return got, log


def test_trl_110_client_reads_our_sequence_logprobs_route(
    vllm_teacher: ServerProcess, trl_110: Path, grpc_rows: dict[str, list[Any]]
) -> None:
    """TRL 1.10's client (``/get_sequence_logprobs/``), binary and JSON formats."""
    seqs, lengths = _sequences(), [0, 1, 10, 300]
    want = _expected(grpc_rows, seqs, lengths)
    got, log = _run_110(trl_110, [vllm_teacher.http, seqs, lengths, K, True])
    assert TRL_110 in log
    want_binary = {**want, "actual_token_ids": [r[:] for r in want["actual_token_ids"]]}
    want_binary["actual_token_ids"][0][0] = [0]  # TRL 1.10 leaves position 0's id at 0
    for key in KEYS:
        assert got[key] == want_binary[key], key
    got, _ = _run_110(trl_110, [vllm_teacher.http, seqs, lengths, K, False])
    # JSON: vLLM's entry as is, sorted by rank: the top K, then the prompt token when it
    # is not among them; position 0 is an empty list.
    assert set(got) == {"logprobs", "logprob_token_ids"}
    for b, (seq, start) in enumerate(zip(seqs, lengths, strict=True)):
        for j, p in enumerate(range(start, len(seq))):
            ids, lps = got["logprob_token_ids"][b][j], got["logprobs"][b][j]
            if p == 0:
                assert ids == [] and lps == []
                continue
            extra = [] if seq[p] in want["logprob_token_ids"][b][j] else [seq[p]]
            assert ids == want["logprob_token_ids"][b][j] + extra
            assert lps == want["logprobs"][b][j] + [want["actual_logprobs"][b][j][0]] * len(extra)


def _post(server: ServerProcess, path: str, body: Any) -> requests.Response:
    return requests.post(f"{server.http}{path}", json=body, timeout=60)


def _refused(r: requests.Response, status: int, pattern: str) -> None:
    import re

    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert re.search(pattern, body["error"]), body


def test_refusals_name_the_field_and_the_server_keeps_serving(
    vllm_teacher: ServerProcess, trl_client: Any
) -> None:
    seqs = _sequences()[:2]
    # Through TRL's own client: its exception carries our status and message.
    with pytest.raises(
        Exception,
        match=r"400.*temperature: the request asks for 2, .*serves "
        r"teacher_temperature 1\b",
    ):
        trl_client.get_sequence_logprobs(seqs, [0, 0], top_logprobs=4, temperature=2.0)
    with pytest.raises(Exception, match=r"400.*prompt_logprobs: 300 is outside \[1, 256\]"):
        trl_client.get_sequence_logprobs(seqs, [0, 0], top_logprobs=300)
    ok = {"sequences": seqs, "prompt_lengths": [0, 1], "top_logprobs": 4}
    cases: list[tuple[str, dict[str, Any], int, str]] = [
        ("/get_sequence_logprobs/", {**ok, "temperature": 0.5}, 400,
         r"temperature: the request asks for 0\.5, .*teacher_temperature 1"),
        ("/get_sequence_logprobs/", {**ok, "top_logprobs": 257}, 400,
         r"^top_logprobs: 257 is outside \[1, 256\] \(max_top_k\)"),
        ("/get_sequence_logprobs/", {**ok, "prompt_lengths": [0, 3]}, 400,
         r"^prompt_lengths\[1\]: 3 is outside \[0, 2\]"),
        ("/get_sequence_logprobs/", {**ok, "prompt_lengths": [0]}, 400,
         r"^prompt_lengths: 1 values for 2 sequences"),
        ("/get_sequence_logprobs/", {**ok, "sequences": [seqs[0], [5, 512]]}, 400,
         r"^sequences\[1\]\[1\]: 512 is outside the vocabulary \[0, 512\)"),
        ("/get_sequence_logprobs/", {**ok, "sequences": [seqs[0], [5, None]]}, 400,
         r"^sequences\[1\]\[1\]: expected a token id \(int\), got null"),
        ("/get_sequence_logprobs/", {**ok, "sequences": [seqs[0], []]}, 400,
         r"^sequences\[1\]: empty"),
        ("/get_sequence_logprobs/", {"prompt_lengths": [0], "top_logprobs": 4}, 400,
         r"^sequences: missing"),
        ("/get_sequence_logprobs/", {**ok, "response_format": "npz"}, 400,
         r"^response_format: \"npz\" is not one of json, binary"),
        ("/v1/completions", {"prompt": [[1, 2, -1]], "prompt_logprobs": 4}, 400,
         r"^prompt\[0\]\[2\]: -1 is outside the vocabulary"),
        ("/v1/completions", {"prompt": [[1, 2]]}, 400, r"^prompt_logprobs: missing"),
        ("/v1/completions", {"prompt": [[1, 2]], "prompt_logprobs": 4, "stream": True}, 400,
         r"^stream: not supported"),
        ("/v1/completions", {"prompt": [[1, 2]], "prompt_logprobs": 4, "max_tokens": 16}, 400,
         r"^max_tokens: 16"),
        ("/v1/completions", {"prompt": [[1, 2]], "prompt_logprobs": 4, "suffix": "x"}, 400,
         r"^suffix: \"x\" is not supported by this teacher \(nothing is generated"),
        ("/v1/completions", {"prompt": [[1, 2]], "prompt_logprobs": 4, "model": "x"}, 400,
         r"^model: 'x' is not served here"),
    ]  # fmt: skip
    for path, body, status, pattern in cases:
        _refused(_post(vllm_teacher, path, body), status, pattern)
    r = requests.post(f"{vllm_teacher.http}/v1/completions", data=b"{nope", timeout=60)
    _refused(r, 400, r"^body: not valid JSON")
    # Still serving, on both routes and over gRPC.
    assert _post(vllm_teacher, "/get_sequence_logprobs/", ok).status_code == 200
    got = trl_client.get_sequence_logprobs(seqs, [0, 1], top_logprobs=4)
    assert [len(r) for r in got["logprobs"]] == [len(seqs[0]), len(seqs[1]) - 1]
    with TeacherClient(vllm_teacher.target) as client:
        assert client.score(seqs, 4).num_positions == sum(map(len, seqs))
    metrics = requests.get(f"{vllm_teacher.http}/metrics", timeout=10).text
    assert 'method="HTTP /v1/completions"' in metrics
    assert 'code="INVALID_ARGUMENT",method="HTTP /get_sequence_logprobs"' in metrics


@pytest.fixture
def replay_with_token(teacher_factory: Any, tmp_path: Path) -> Iterator[ServerProcess]:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    recording = ROOT / "tests" / "data" / "tiny_vllm_recording"
    yield teacher_factory(
        ["--backend", "replay", "--recording", str(recording), "--token-file", str(token)]
    )


def test_trl_routes_on_replay_need_the_token(replay_with_token: ServerProcess) -> None:
    """The routes on the replay backend, bearer token required: the recorded values, the
    same as replay over gRPC; unrecorded sequences are 404 naming them."""
    from trl.generation.vllm_client import VLLMClient

    from topk_protocol.recording import RecordingReader

    server = replay_with_token
    with RecordingReader(ROOT / "tests" / "data" / "tiny_vllm_recording") as reader:
        tokens = next(
            t
            for t, r in reader
            if r.position_start == 0
            and r.position_end >= len(t) - 1 > 4
            and r.sampled_logprobs is not None
        )
        seq = tokens.tolist()
    body = {"sequences": [seq], "prompt_lengths": [1], "top_logprobs": 8}
    _refused(_post(server, "/get_sequence_logprobs/", body), 401, "^authorization: ")
    _refused(_post(server, "/v1/completions", {"prompt": [seq]}), 401, "^authorization: ")
    client = VLLMClient(base_url=server.http)  # /health and /v1/models are open
    client.session.headers["Authorization"] = "Bearer s3cret"  # docs/trl.md
    got = client.get_sequence_logprobs([seq], [1], top_logprobs=8)
    with TeacherClient(server.target, token="s3cret") as grpc_client:
        p = grpc_client.score([seq], 8, dtype="float32", positions=[(0, len(seq) - 1)])
    assert as_float32(got["logprobs"][0]) == p.logprobs[0].tolist()
    assert got["logprob_token_ids"][0] == p.ids[0].tolist()
    with pytest.raises(Exception, match=r"404.*recording tiny_vllm_recording: not recorded"):
        client.get_sequence_logprobs([[1, 2, 3]], [0], top_logprobs=8)
