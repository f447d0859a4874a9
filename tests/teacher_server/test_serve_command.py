"""The README's serve command, copied from the README, on a CPU machine: it starts without
``VLLM_CPU_KVCACHE_SPACE``, answers probes from the moment its HTTP port opens while the
engine loads, refuses scoring until warmed up, announces the engine's real dtype (the
CPU's rule: ``cpu_dtype``), and drains on SIGTERM.

The only substitutions: ``MODEL_DIR`` -> the tiny model, and the two README ports -> free
ports (other jobs may hold 50051/8000 on a shared machine). One extra vLLM engine: a
start-up is what is under test, the session's shared server is already up.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import ROOT, free_port
from grpc_health.v1 import health_pb2, health_pb2_grpc

from teacher_server.backends.cpu_dtype import cpu_has_native_bf16
from teacher_server.backends.cpu_kv_cache import CPU_KV_CACHE_ENV
from teacher_server.lifecycle import DEFAULT_DRAIN_TIMEOUT_S, SHUTDOWN_MARGIN_S
from topk_protocol import encode_token_ids, pb, pb_grpc

pytestmark = pytest.mark.vllm

#: A probe that has not answered in this long has hung (a stop, not the measure: how long
#: probes take is compared with the engine's load time, measured in the same test).
PROBE_HANG_S = 30.0
#: The slowest probe while the engine loads stays under this share of the load: the engine
#: is built in a worker thread; were the build on the event loop, a probe would wait for
#: much of the load (measured in healthy runs: at most 0.98 s of a 60-100 s load).
PROBE_SHARE_OF_LOAD = 0.1
LOAD_TIMEOUT_S = 600.0


def readme_serve_command() -> list[str]:
    """The first ``teacher-server serve`` line of the README's teacher-server section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The teacher server", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    lines = [ln for b in blocks for ln in b.splitlines() if ln.startswith("teacher-server serve")]
    assert lines, "no `teacher-server serve` command in the README's teacher-server section"
    return shlex.split(lines[0])


def _get(url: str) -> tuple[int, float]:
    """(status, seconds) of GET url; raises OSError when refused or hung."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=PROBE_HANG_S) as r:
            status = int(r.status)
    except urllib.error.HTTPError as e:
        status = int(e.code)
    return status, time.monotonic() - t0


def _score_request() -> pb.ScoreRequest:
    ids = encode_token_ids(np.arange(16) % 256)
    return pb.ScoreRequest(
        request_id="early", top_k=4, sequences=[pb.SequenceRequest(token_ids=ids)]
    )


def test_readme_serve_command_starts_probes_and_drains(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    argv = readme_serve_command()
    assert argv[:2] == ["teacher-server", "serve"]
    port, http_port = free_port(), free_port()
    subst = {"MODEL_DIR": str(tiny_model_dir), "50051": str(port), "8000": str(http_port)}
    assert set(subst) <= set(argv), f"README command changed shape: {argv}"
    exe = Path(sys.executable).parent / "teacher-server"  # the installed console script
    cmd = [str(exe), *[subst.get(a, a) for a in argv[1:]]]
    env = {k: v for k, v in os.environ.items() if k != CPU_KV_CACHE_ENV}
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{http_port}"
    healthz: list[tuple[int, float]] = []
    probe_log: list[tuple[float, float]] = []
    readyz: list[int] = []
    early_codes: list[grpc.StatusCode] = []
    health_before: list[int] = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.TeacherStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + LOAD_TIMEOUT_S
            while time.monotonic() < deadline:
                assert proc.poll() is None, log_path.read_text()[-4000:]
                try:
                    t_probe = time.time()
                    healthz.append(_get(f"{base}/healthz"))
                    probe_log.append((t_probe, healthz[-1][1]))
                except OSError:
                    if healthz:  # up once: every later probe must answer
                        pytest.fail(f"/healthz stopped answering after {len(healthz)} probes")
                    time.sleep(0.25)
                    continue
                status, _ = _get(f"{base}/readyz")
                readyz.append(status)
                if status == 200:
                    break
                if len(early_codes) < 3:  # a Score before ready: UNAVAILABLE (retryable)
                    req = health_pb2.HealthCheckRequest(service="topk_distill.v1.Teacher")
                    checked = health.Check(req, timeout=5).status
                    try:
                        stub.Score(_score_request(), timeout=5)
                    except grpc.RpcError as e:
                        early_codes.append(e.code())
                        health_before.append(checked)
                    else:  # it became ready between the two probes
                        assert _get(f"{base}/readyz")[0] == 200
                time.sleep(0.25)
            else:
                pytest.fail(f"not ready after {LOAD_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            info = stub.GetInfo(pb.GetInfoRequest(), timeout=10)
            assert stub.Score(_score_request(), timeout=60).final
        with urllib.request.urlopen(f"{base}/v1/info", timeout=5) as r:
            info_json = json.loads(r.read())
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        try:
            code = proc.wait(DEFAULT_DRAIN_TIMEOUT_S + SHUTDOWN_MARGIN_S + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        exit_s = time.monotonic() - t_term

    slowest = max(s for _, s in healthz)
    load_s = probe_log[-1][0] + probe_log[-1][1] - probe_log[0][0]  # first probe to ready
    slow = [
        (time.strftime("%H:%M:%S", time.localtime(t)), round(d, 3)) for t, d in probe_log if d > 0.2
    ]
    print("slow /healthz probes (wall clock, s):", slow)
    print(
        f"/healthz: {len(healthz)} probes, all 200: {all(c == 200 for c, _ in healthz)}, "
        f"slowest {slowest:.3f} s of a {load_s:.1f} s load; /readyz 503 x{readyz.count(503)} "
        "then 200; "
        f"early Score: {[c.name for c in early_codes]}; exit {code} after {exit_s:.1f} s"
    )
    assert all(c == 200 for c, _ in healthz)
    assert slowest < PROBE_SHARE_OF_LOAD * load_s, (slowest, load_s)
    assert readyz[-1] == 200 and set(readyz[:-1]) <= {503}
    assert readyz.count(503) >= 1, "the engine loaded before the first probe: nothing tested"
    assert early_codes and set(early_codes) == {grpc.StatusCode.UNAVAILABLE}
    assert set(health_before) == {health_pb2.HealthCheckResponse.NOT_SERVING}
    # `--dtype auto` (vLLM's default): vLLM runs the float32 checkpoint in bfloat16 on a
    # CPU with native bf16, the server keeps float32 on one without; it says which, and why.
    want = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert info.engine_dtype == info_json["engine_dtype"] == want
    assert f"vLLM engine computes in {want} (--dtype auto: this CPU has" in log_path.read_text()
    assert code == 0
    assert exit_s <= DEFAULT_DRAIN_TIMEOUT_S + SHUTDOWN_MARGIN_S
