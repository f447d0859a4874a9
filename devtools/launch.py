"""Start a ``teacher-server serve`` subprocess on loopback and wait until it is ready.

For examples, benchmarks and tests (one real server, real ports): the parent picks free
ports, starts ``python -m teacher_server serve ...``, polls ``/readyz`` and stops it with
SIGTERM (which drains) when done.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TeacherProcess", "free_port", "http_status", "start_teacher"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def http_status(
    url: str,
    headers: dict[str, str] | None = None,
    timeout_s: float = 5,
    *,
    cafile: str | Path | None = None,
) -> int:
    """The HTTP status of ``GET url`` (errors included, e.g. 503); ``cafile``: the
    certificate to trust for ``https://`` (the server's own, when self-signed)."""
    req = urllib.request.Request(url, headers=headers or {})
    context = ssl.create_default_context(cafile=str(cafile)) if cafile else None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=context) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@dataclass
class TeacherProcess:
    """A running ``teacher-server serve`` subprocess on loopback."""

    proc: subprocess.Popen[bytes]
    port: int
    http_port: int
    log_path: Path
    tls_cert: Path | None = None  # with TLS, HTTP is HTTPS with this certificate

    @property
    def target(self) -> str:
        """The gRPC target, ``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        """The HTTP base URL (``https://`` with TLS)."""
        scheme = "https" if self.tls_cert else "http"
        return f"{scheme}://127.0.0.1:{self.http_port}"

    def http_status(self, path: str, headers: dict[str, str] | None = None) -> int:
        """The status of ``GET path`` on this server's HTTP port."""
        return http_status(f"{self.http}{path}", headers, cafile=self.tls_cert)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM (drain), wait; SIGKILL after ``timeout_s``. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def start_teacher(
    args: list[str],
    log_path: str | Path,
    *,
    ready_timeout_s: float = 600,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> TeacherProcess:
    """Start ``python -m teacher_server serve ARGS`` on free loopback ports and wait until
    ``/readyz`` answers 200 (in ``cwd``, default this process's: ``-m`` imports from the
    working directory first). ``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 GiB. Raises
    ``RuntimeError`` (with the log's tail) if the process exits or is not ready in time."""
    port, http_port = free_port(), free_port()
    cmd = [
        sys.executable, "-m", "teacher_server", "serve",
        "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port),
        *args,
    ]  # fmt: skip
    full_env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, **(env or {})}
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd)
    tls_cert = Path(args[args.index("--tls-cert") + 1]) if "--tls-cert" in args else None
    server = TeacherProcess(proc, port, http_port, log_path, tls_cert)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"teacher-server exited with {proc.returncode}:\n{server.log()[-4000:]}"
            )
        with contextlib.suppress(OSError):
            if server.http_status("/readyz") == 200:
                return server
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(
        f"teacher-server not ready after {ready_timeout_s} s:\n{server.log()[-4000:]}"
    )
