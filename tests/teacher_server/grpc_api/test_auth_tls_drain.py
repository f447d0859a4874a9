"""Token auth, TLS (gRPC and HTTPS), open reflection and the draining shutdown within its
budget, on real servers (transformers backend, which starts in seconds; the gRPC/HTTP
layers are the same for every backend)."""

from __future__ import annotations

import datetime
import ipaddress
import signal
import time
from pathlib import Path
from urllib.error import URLError

import grpc
import numpy as np
import pytest
from conftest import http_status
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from teacher_server.lifecycle import SHUTDOWN_MARGIN_S
from topk_protocol import encode_token_ids, pb, pb_grpc


def _req(n: int = 5, request_id: str = "r", k: int = 4) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        request_id=request_id,
        top_k=k,
        sequences=[pb.SequenceRequest(token_ids=encode_token_ids(np.arange(n) % 512))],
    )


def test_bearer_token(teacher_factory, tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    server = teacher_factory(
        [
            "--backend",
            "transformers",
            "--model",
            str(tiny_model_dir),
            "--token-file",
            str(token_file),
        ]
    )
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.TeacherStub(ch)
        for metadata, why in [((), "missing"), ((("authorization", "Bearer nope"),), "wrong")]:
            for call in (
                lambda md: stub.Score(_req(), metadata=md),
                lambda md: stub.GetInfo(pb.GetInfoRequest(), metadata=md),
                lambda md: list(stub.ScoreStream(iter([_req()]), metadata=md)),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert why in err.value.details() and "authorization" in err.value.details()
        good = (("authorization", "Bearer s3cret"),)
        assert stub.Score(_req(), metadata=good).sequences[0].num_positions == 5
        assert [m.final for m in stub.ScoreStream(iter([_req()]), metadata=good)] == [True]
        # Orchestrator probes need no token.
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        # Reflection is open too (schema only): what `grpcurl -plaintext HOST:PORT list`
        # asks, through grpcio-reflection's client (grpcurl itself is not installed here).
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert {"topk_distill.v1.Teacher", "grpc.health.v1.Health"} <= services
    assert http_status(f"{server.http}/v1/info") == 401
    assert http_status(f"{server.http}/v1/info", {"authorization": "Bearer s3cret"}) == 200
    assert http_status(f"{server.http}/readyz") == 200


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "server.crt", tmp_path / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls(teacher_factory, tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """TLS on gRPC and on the HTTP port (same certificate): the token never goes in clear."""
    cert, key = _self_signed(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret")
    server = teacher_factory(
        [
            "--backend", "transformers", "--model", str(tiny_model_dir),
            "--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(token_file),
        ]
    )  # fmt: skip
    good = (("authorization", "Bearer s3cret"),)
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with grpc.secure_channel(f"localhost:{server.port}", creds) as ch:
        assert pb_grpc.TeacherStub(ch).Score(_req(), timeout=30, metadata=good).final
    # A plaintext client cannot talk to the TLS port.
    with grpc.insecure_channel(server.target) as ch, pytest.raises(grpc.RpcError) as err:
        pb_grpc.TeacherStub(ch).Score(_req(), timeout=5, metadata=good)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    # HTTP: plain HTTP fails, HTTPS with the token works.
    assert server.http.startswith("https://")
    plain = f"http://127.0.0.1:{server.http_port}/v1/info"
    with pytest.raises((URLError, ConnectionError)):
        http_status(plain, {"authorization": "Bearer s3cret"})
    assert server.http_status("/v1/info", {"authorization": "Bearer s3cret"}) == 200
    assert server.http_status("/v1/info") == 401
    assert server.http_status("/healthz") == 200


def _transformers_server(teacher_factory, model: Path, *flags: object):  # type: ignore[no-untyped-def]
    return teacher_factory(
        ["--backend", "transformers", "--model", str(model), *(str(f) for f in flags)]
    )


def test_sigterm_drains(teacher_factory, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM: health NOT_SERVING and /readyz 503 at once, in-flight calls finish, new
    ones are refused, then the process exits 0 within --drain-timeout-s + the margin."""
    drain_s = 60.0
    server = _transformers_server(teacher_factory, tiny_model_dir, "--drain-timeout-s", drain_s)
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.TeacherStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        # Work that takes a few seconds even on a fast CPU (six of these were all done
        # within 0.5 s on one): requests are served one at a time.
        pending = [stub.Score.future(_req(4000, f"r{i}", 16), timeout=120) for i in range(24)]
        time.sleep(0.5)
        assert not all(f.done() for f in pending)
        server.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        deadline = time.monotonic() + 10
        status = None
        while time.monotonic() < deadline:
            status = health.Check(health_pb2.HealthCheckRequest()).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.05)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert server.http_status("/readyz") == 503
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(_req(request_id="late"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        results = [f.result() for f in pending]
    assert all(r.final and r.sequences[0].num_positions == 4000 for r in results)
    assert server.proc.wait(drain_s + SHUTDOWN_MARGIN_S) == 0
    assert time.monotonic() - t_term <= drain_s + SHUTDOWN_MARGIN_S


def test_drain_budget_bounds_the_whole_shutdown(teacher_factory, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """More work in flight than the budget allows: the process still exits 0 within
    --drain-timeout-s + the margin; what could not finish is refused or cancelled (the
    client re-sends it elsewhere), never answered wrongly."""
    drain_s = 3.0
    server = _transformers_server(teacher_factory, tiny_model_dir, "--drain-timeout-s", drain_s)
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.TeacherStub(ch)
        one = float("inf")
        for i in range(3):  # the fastest of three: load on the machine only slows a call
            t0 = time.monotonic()
            stub.Score(_req(4000, f"timing-{i}", 16), timeout=60)
            one = min(one, time.monotonic() - t0)
        # Work for 3x the budget (requests are served one at a time), and at least 40
        # requests, so that a quiet moment of the machine cannot finish it all in time.
        n = max(int(3 * drain_s / one) + 10, 40)
        pending = [stub.Score.future(_req(4000, f"r{i}", 16), timeout=120) for i in range(n)]
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        assert server.proc.wait(drain_s + SHUTDOWN_MARGIN_S + 5) == 0
        elapsed = time.monotonic() - t_term
        codes = []
        for f in pending:
            try:
                assert f.result().sequences[0].num_positions == 4000
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
    assert elapsed <= drain_s + SHUTDOWN_MARGIN_S, f"exit took {elapsed:.1f} s"
    assert codes.count(grpc.StatusCode.OK) < n, "the work was meant to outlast the budget"
    assert set(codes) <= {
        grpc.StatusCode.OK,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
    }, codes
