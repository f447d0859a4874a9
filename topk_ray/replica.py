"""One teacher replica as a Ray actor: a ``teacher-server serve`` process on a fixed
port, tied to the actor's life.

The actor starts the server as its child (killed with it: ``PR_SET_PDEATHSIG``) and
watches it: when the server process dies, the actor exits, and Ray restarts the actor
(``max_restarts``), which starts the server again on the same port. ``drain()`` sends the
server SIGTERM: the server's own drain (NOT_SERVING, the requests in flight finish).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["ReplicaProcess"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the server gets SIGKILL when the actor process dies, however it dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ReplicaProcess:
    """The actor's body (wrapped with ``ray.remote`` by the pool): ``serve_args`` are
    ``teacher-server serve`` flags (no ports: ``port`` and ``http_port`` are the
    replica's, the same after every restart); the log goes to ``log_dir``."""

    def __init__(
        self,
        index: int,
        serve_args: list[str],
        port: int,
        http_port: int,
        log_dir: str,
        registry: str | None = None,
    ) -> None:
        import ray

        self.index = index
        self._registry = registry
        self._registered = threading.Lock()
        self.host = ray.util.get_node_ip_address()
        self.port, self.http_port = port, http_port
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.log_path = Path(log_dir) / f"replica-{index}.log"
        cmd = [
            sys.executable, "-m", "teacher_server", "serve",
            "--host", "0.0.0.0", "--port", str(port), "--http-port", str(http_port),
            *serve_args,
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            log.write(f"\n== replica {index} starts (actor pid {os.getpid()})\n".encode())
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        self._draining = False
        self._ever_ready = False
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        """Exit the actor when its server dies after it was ready (unless drained): Ray
        restarts it. A server that fails to start leaves the actor alive, for the pool to
        read the log and report it."""
        while self._proc.poll() is None and not self._ever_ready:
            self.ready()
            time.sleep(0.5)
        code = self._proc.wait()
        if self._ever_ready and not self._draining:
            print(f"replica {self.index}: server exited with {code}; restarting", flush=True)
            os._exit(1)

    def address(self) -> tuple[str, int, int, int]:
        """``(node ip, gRPC port, HTTP port, server pid)``."""
        return self.host, self.port, self.http_port, self._proc.pid

    def ready(self) -> bool:
        """Whether the server answers ``/readyz`` with 200."""
        if self._proc.poll() is not None:
            return False
        try:
            url = f"http://127.0.0.1:{self.http_port}/readyz"
            with urllib.request.urlopen(url, timeout=5) as r:
                ok = int(r.status) == 200
        except (OSError, urllib.error.HTTPError):
            return False
        if ok and not self._ever_ready:
            with self._registered:
                if not self._ever_ready:
                    self._register()
                    self._ever_ready = True
        return ok

    def _register(self) -> None:
        """Write this replica's target to the pool's registry (once per actor start,
        before the pool's ``wait_ready`` hears it is ready)."""
        import ray

        from topk_ray.pool_registry import NAMESPACE

        if self._registry is not None:
            registry = ray.get_actor(self._registry, namespace=NAMESPACE)
            ray.get(registry.set.remote(self.index, f"{self.host}:{self.port}"), timeout=60)

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until ready; False if the server exited or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready():
                return True
            if self._proc.poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def alive(self) -> bool:
        """Whether the server process runs."""
        return self._proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log since this start."""
        text = self.log_path.read_text(errors="replace")
        return text[text.rfind("\n== replica ") :][-chars:]

    def drain(self, timeout_s: float) -> int:
        """SIGTERM the server (its drain), wait up to ``timeout_s``; its exit code."""
        self._draining = True
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        return int(self._proc.returncode)
