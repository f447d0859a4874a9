"""Token auth, TLS and the draining shutdown, on real servers (transformers backend, which
starts in seconds; the gRPC/HTTP layers are the same for every backend)."""

from __future__ import annotations

import datetime
import ipaddress
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import http_status
from grpc_health.v1 import health_pb2, health_pb2_grpc

from student_client.wire import encode_token_ids, pb, pb_grpc


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
    cert, key = _self_signed(tmp_path)
    server = teacher_factory(
        [
            "--backend", "transformers", "--model", str(tiny_model_dir),
            "--tls-cert", str(cert), "--tls-key", str(key),
        ]
    )  # fmt: skip
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with grpc.secure_channel(f"localhost:{server.port}", creds) as ch:
        assert pb_grpc.TeacherStub(ch).Score(_req(), timeout=30).final
    # A plaintext client cannot talk to the TLS port.
    with grpc.insecure_channel(server.target) as ch, pytest.raises(grpc.RpcError) as err:
        pb_grpc.TeacherStub(ch).Score(_req(), timeout=5)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_sigterm_drains(teacher_factory, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM: health NOT_SERVING and /readyz 503 at once, in-flight calls finish, new
    ones are refused, then the process exits 0."""
    server = teacher_factory(["--backend", "transformers", "--model", str(tiny_model_dir)])
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.TeacherStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        # Work that takes a few seconds: requests are served one at a time.
        pending = [stub.Score.future(_req(4000, f"r{i}", 16), timeout=120) for i in range(6)]
        time.sleep(0.5)
        assert not all(f.done() for f in pending)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        status = None
        while time.monotonic() < deadline:
            status = health.Check(health_pb2.HealthCheckRequest()).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.05)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert http_status(f"{server.http}/readyz") == 503
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(_req(request_id="late"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        results = [f.result() for f in pending]
    assert all(r.final and r.sequences[0].num_positions == 4000 for r in results)
    assert server.proc.wait(60) == 0
