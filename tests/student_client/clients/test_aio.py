"""The client against real teacher-server subprocesses (transformers backend, tiny model):
values, prefetch, message-size limits, targets, TLS, auth and the typed errors."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ServerProcess, free_port, start_server

from student_client.clients.blocking import TeacherClient
from student_client.data.batch import ScoreBatch
from teacher_server.backends.transformers_backend import TransformersBackend
from teacher_server.validation import ParsedSequence
from topk_protocol import RequestOptions
from topk_protocol.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    TeacherUnavailableError,
    UnauthenticatedError,
    VocabMismatchError,
)

K = 8


def requests_ok(server: ServerProcess, method: str) -> int:
    """The server's count of answered requests of ``method`` (``/metrics``)."""
    with urllib.request.urlopen(f"{server.http}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for labels, value in re.findall(r"^topk_teacher_requests_total\{([^}]*)\} (\S+)$", text, re.M):
        if 'code="OK"' in labels and f'method="{method}"' in labels:
            total += float(value)
    return int(total)


@pytest.fixture(scope="module")
def teacher(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One transformers-backed teacher: 1 MiB message limit, 1 KiB stream chunks."""
    log = tmp_path_factory.mktemp("teacher") / "server.log"
    server = start_server(
        [
            "--backend",
            "transformers",
            "--model",
            str(tiny_model_dir),
            "--max-top-k",
            "64",
            "--max-message-mb",
            "1",
            "--chunk-kb",
            "1",
        ],
        log,
    )
    yield server
    server.stop()


def test_info_and_score_match_the_reference(
    teacher: ServerProcess, reference_backend: TransformersBackend
) -> None:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 512, size=n) for n in (40, 3, 17)]
    spans = [(0, 40), (1, 3), (5, 12)]
    with TeacherClient(teacher.target, expect_vocab_size=512) as client:
        info = client.info()
        assert (info.vocab_size, info.max_top_k, info.backend) == (512, 64, "transformers")
        assert info.max_message_bytes == 1 << 20
        p = client.score(seqs, K, dtype="float32", positions=spans)
    assert p.ids.shape == (3, 40, K)
    assert p.sampled_logprobs is not None
    for b, (x, (s, e)) in enumerate(zip(seqs, spans, strict=True)):
        ref = reference_backend.score_sync(
            ParsedSequence(x.astype(np.int32), s, e), RequestOptions(K)
        )
        n = e - s
        assert p.mask[b].sum().item() == n
        np.testing.assert_array_equal(p.ids[b, :n].numpy(), ref.ids)
        np.testing.assert_array_equal(p.logprobs[b, :n].numpy(), ref.logprobs)
        np.testing.assert_array_equal(
            p.sampled_logprobs[b, :n].isnan().numpy(), np.isnan(ref.sampled_logprobs)
        )
        np.testing.assert_allclose(
            p.sampled_logprobs[b, :n].nan_to_num(0).numpy(), np.nan_to_num(ref.sampled_logprobs)
        )


def test_stream_equals_score_on_ragged_batches(teacher: ServerProcess) -> None:
    rng = np.random.default_rng(1)
    batches = [
        [torch.from_numpy(rng.integers(0, 512, size=int(rng.integers(1, 60)))) for _ in range(3)]
        for _ in range(6)
    ]
    with TeacherClient(teacher.target) as client:
        streamed = list(client.stream(batches, K, depth=3, dtype="bfloat16"))
        for b, p in zip(batches, streamed, strict=True):
            one = client.score(b, K, dtype="bfloat16")
            assert torch.equal(p.ids, one.ids) and torch.equal(p.logprobs, one.logprobs)
            assert torch.equal(p.mask, one.mask)


@pytest.mark.parametrize("depth", [0, 3])
def test_prefetch_overlaps_student_compute(teacher: ServerProcess, depth: int) -> None:
    """While the caller holds payload 0 (and has not asked for payload 1), the teacher
    receives and answers requests 1..depth: seen in the server's own counters."""
    rng = np.random.default_rng(2)
    batches = [[rng.integers(0, 512, size=64)] for _ in range(8)]
    pulled: list[int] = []

    def source() -> Iterator[list[np.ndarray]]:
        for i, b in enumerate(batches):
            pulled.append(i)
            yield b

    with TeacherClient(teacher.target) as client:
        client.info()
        before = requests_ok(teacher, "ScoreStream")
        it = client.stream(source(), K, depth=depth)
        next(it)
        # The "student step" on payload 0: wait for the teacher's counter, up to 20 s.
        deadline = time.monotonic() + (20 if depth else 1.5)
        while (
            time.monotonic() < deadline and requests_ok(teacher, "ScoreStream") - before < 1 + depth
        ):
            time.sleep(0.05)
        answered = requests_ok(teacher, "ScoreStream") - before
        assert answered == 1 + depth
        assert pulled == list(range(1 + depth))  # lazily: only depth batches ahead
        rest = list(it)
    assert len(rest) == 7


def test_large_answer_goes_through_scorestream(teacher: ServerProcess) -> None:
    """2 x 2048 positions at K=64 float16 is ~1.6 MB, over the server's 1 MiB limit."""
    x = torch.randint(0, 512, (2, 2048), generator=torch.Generator().manual_seed(3))
    with TeacherClient(teacher.target) as client:
        unary0 = requests_ok(teacher, "Score")
        stream0 = requests_ok(teacher, "ScoreStream")
        big = client.score(x, 64)
        assert requests_ok(teacher, "ScoreStream") == stream0 + 1
        assert requests_ok(teacher, "Score") == unary0
        small = client.score(x[:, :100], 64, positions=[(90, 100), (0, 5)])
        assert requests_ok(teacher, "Score") == unary0 + 1
    assert big.ids.shape == (2, 2048, 64) and bool(big.mask.all())
    assert torch.equal(big.ids[0, 90:100], small.ids[0, :10])
    assert torch.equal(big.logprobs[1, :5], small.logprobs[1, :5])


def test_invalid_requests_raise_typed_errors(teacher: ServerProcess) -> None:
    with TeacherClient(teacher.target) as client:
        with pytest.raises(
            InvalidRequestError, match=r"token_ids\[2\]: 9999 is outside the vocabulary \[0, 512\)"
        ):
            client.score([[1, 2, 9999]], K)
        with pytest.raises(InvalidRequestError, match=r"top_k: 65 is outside \[1, 64\]"):
            client.score([[1, 2, 3]], 65)
        with pytest.raises(InvalidRequestError, match="top_k"):
            list(client.stream([[[1, 2, 3]]], 65))
        x = torch.randint(0, 512, (4, 1024))
        with pytest.raises(DeadlineExceededError):
            client.score(x, K, timeout_s=0.001)
        # The client is still usable after errors.
        assert client.score([[1, 2, 3]], K).ids.shape == (1, 3, K)


def test_vocab_mismatch_is_caught_before_the_first_request(teacher: ServerProcess) -> None:
    before = requests_ok(teacher, "Score") + requests_ok(teacher, "ScoreStream")
    with TeacherClient(teacher.target, expect_vocab_size=320) as client:
        with pytest.raises(
            VocabMismatchError, match="vocab_size: the teacher has 512, the student expects 320"
        ):
            client.score([[1, 2, 3]], K)
        with pytest.raises(VocabMismatchError):
            next(client.stream([[[1, 2, 3]]], K))
    client = TeacherClient(teacher.target, expect_tokenizer_fingerprint="0" * 64)
    with client, pytest.raises(VocabMismatchError, match=r"tokenizer_fingerprint: .* '0{64}'"):
        client.info()
    assert requests_ok(teacher, "Score") + requests_ok(teacher, "ScoreStream") == before


def test_unreachable_teacher_raises_after_all_tries() -> None:
    port = free_port()  # nothing listens there
    with TeacherClient(f"127.0.0.1:{port}", retries=2, backoff_s=0.01, timeout_s=5) as client:
        with pytest.raises(TeacherUnavailableError, match="unavailable after 3 tries"):
            client.score([[1, 2]], K)
        with pytest.raises(TeacherUnavailableError, match="unavailable after 3 tries"):
            list(client.stream([[[1, 2]]], K))


def test_dns_target_round_robin(teacher: ServerProcess) -> None:
    with TeacherClient(f"dns:///localhost:{teacher.port}") as client:
        assert client.targets == [f"dns:///localhost:{teacher.port}"]
        assert client.score([[1, 2, 3]], K).ids.shape == (1, 3, K)
        assert len(list(client.stream([[[4, 5]], [[6]]], K))) == 2


def _self_signed_cert(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=teacher.test",
            "-addext", "subjectAltName=DNS:teacher.test,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_and_bearer_token(tiny_model_dir: Path, tmp_path: Path) -> None:
    cert, key = _self_signed_cert(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    server = start_server(
        [
            "--backend", "transformers", "--model", str(tiny_model_dir),
            "--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(token_file),
        ],
        tmp_path / "server.log",
    )  # fmt: skip
    try:
        with TeacherClient(server.target, tls=cert, token="s3cret") as client:
            assert client.score([[1, 2, 3]], K).ids.shape == (1, 3, K)
            assert len(list(client.stream([[[1, 2]], [[3]]], K))) == 2
        no_token = TeacherClient(server.target, tls=cert.read_bytes())
        with no_token, pytest.raises(UnauthenticatedError, match="missing bearer token"):
            no_token.score([[1, 2, 3]], K)
        with TeacherClient(server.target, tls=cert, token="wrong") as client:
            with pytest.raises(UnauthenticatedError, match="wrong token"):
                client.info()
            with pytest.raises(UnauthenticatedError):
                next(client.stream([[[1, 2]]], K))
        # Plaintext against a TLS server: the connection never comes up.
        plain = TeacherClient(server.target, token="s3cret", retries=1, backoff_s=0.01)
        with plain, pytest.raises(TeacherUnavailableError, match="after 2 tries"):
            plain.info()
    finally:
        server.stop()


def test_positions_and_score_batch_in_stream(teacher: ServerProcess) -> None:
    x = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    with TeacherClient(teacher.target) as client:
        full = client.score(x, K)
        part = next(client.stream([ScoreBatch(x, [(2, 5), (1, 1)])], K))
    assert part.position_start.tolist() == [2, 1]
    assert part.lengths.tolist() == [3, 0]
    assert torch.equal(part.ids[0], full.ids[0, 2:5])
    assert not bool(part.mask[1].any())
