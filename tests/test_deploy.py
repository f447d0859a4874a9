"""The deployment files agree with the server they deploy.

No container engine runs here, so these tests parse ``deploy/`` and hold it against the
real code: every flag parses with ``teacher_server.cli.build_parser()``, probe and
health-check paths are routes of the real HTTP app, container ports are the ports the
flags open, the token variable is the one the CLI reads, grace periods cover the drain
budget plus the server's shutdown margin.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from fastapi.routing import APIRoute

from teacher_server import cli
from teacher_server.http_api.app import build_http_app
from teacher_server.lifecycle import SHUTDOWN_MARGIN_S, Lifecycle
from teacher_server.metrics import TeacherMetrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
HEALTH_URL = re.compile(r"https?://[^\s'\"]+")


# -- helpers -------------------------------------------------------------------------------


def http_routes() -> set[str]:
    """GET paths of the teacher's real HTTP app."""
    app = build_http_app(lifecycle=Lifecycle(), info=lambda: None, metrics=TeacherMetrics())
    return {r.path for r in app.routes if isinstance(r, APIRoute) and "GET" in r.methods}


def serve_flags() -> set[str]:
    """Option strings of the real ``teacher-server serve`` sub-command."""
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {opt for action in sub.choices["serve"]._actions for opt in action.option_strings}


def parse_serve(argv: list[str]) -> argparse.Namespace:
    """Parse ``teacher-server ARGV`` with the real parser; unknown flags fail the test, and
    so do abbreviations (argparse would accept them, a later flag could make them ambiguous).
    """
    flags = serve_flags()
    written = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    assert written <= flags, f"not teacher-server serve flags: {sorted(written - flags)}"
    parser = cli.build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit as e:  # argparse reports bad values this way
        pytest.fail(f"teacher-server rejects {argv}: exit {e.code}")
    assert not unknown, f"flags teacher-server does not accept: {unknown}"
    assert args.command == "serve"
    return args


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path}: dangling line continuation"
    return out


def exec_form(value: str) -> list[str]:
    """A Dockerfile JSON (exec form) array; shell form is split like a shell would."""
    value = value.strip()
    if value.startswith("["):
        parsed = json.loads(value)
        assert isinstance(parsed, list) and all(isinstance(x, str) for x in parsed)
        return parsed
    return shlex.split(value)


def url_in(command: list[str] | str) -> tuple[int, str]:
    """(port, path) of the one http URL in a health-check command."""
    text = command if isinstance(command, str) else " ".join(command)
    urls = HEALTH_URL.findall(text)
    assert len(urls) == 1, f"expected one URL in {text!r}"
    parts = urlsplit(urls[0])
    assert parts.port is not None, f"{urls[0]}: no port"
    return parts.port, parts.path


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path}: empty"
    return docs


def duration_seconds(value: str | int | float) -> float:
    """Compose durations: ``45s``, ``1m30s``, ``2m`` or a number of seconds."""
    if isinstance(value, int | float):
        return float(value)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"bad duration {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


# -- Dockerfile ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile() -> dict[str, list[str]]:
    by_kw: dict[str, list[str]] = {}
    for kw, rest in dockerfile_instructions(DEPLOY / "Dockerfile"):
        by_kw.setdefault(kw, []).append(rest)
    return by_kw


def test_dockerfile_base_image_is_pinned(dockerfile: dict[str, list[str]]) -> None:
    (base,) = dockerfile["FROM"]
    if base.startswith("${"):
        name = base[2:].split("}")[0]
        defaults = dict(a.split("=", 1) for a in dockerfile["ARG"] if "=" in a)
        base = defaults[name]
    repo, _, tag = base.rpartition(":")
    assert repo and "/" not in tag, f"FROM {base}: no tag"
    assert tag not in ("latest", ""), f"FROM {base}: pin a release"
    assert "vllm" in repo, f"FROM {base}: expected a vLLM (CUDA) base image"


def test_dockerfile_entrypoint_is_the_console_script(dockerfile: dict[str, list[str]]) -> None:
    (entry,) = dockerfile["ENTRYPOINT"]
    assert exec_form(entry) == ["teacher-server", "serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    # The entry point imports the CLI (or names the missing server extra in one line).
    assert scripts["teacher-server"] == "teacher_server.__main__:main"
    assert cli.main.__module__ == "teacher_server.cli"


def test_dockerfile_cmd_ports_and_healthcheck(dockerfile: dict[str, list[str]]) -> None:
    (cmd,) = dockerfile["CMD"]
    args = parse_serve(["serve", *exec_form(cmd)])
    exposed = {int(p.split("/")[0]) for line in dockerfile["EXPOSE"] for p in line.split()}
    assert exposed == {args.port, args.http_port}
    (health,) = dockerfile["HEALTHCHECK"]
    options, _, command = health.partition("CMD")
    assert "--start-period" in options
    port, path = url_in(exec_form(command))
    assert port == args.http_port
    assert path == "/healthz"
    assert path in http_routes()


def test_dockerfile_copies_existing_paths_and_known_extras(
    dockerfile: dict[str, list[str]],
) -> None:
    for line in dockerfile["COPY"]:
        *sources, _dest = shlex.split(line)
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    installs = [r for r in dockerfile["RUN"] if "pip install" in r]
    assert installs, "the image must install the project"
    for run in installs:
        for group in re.findall(r"\.\[([\w,-]+)\]", run):
            for extra in group.split(","):
                assert extra in extras, f"RUN {run}: no extra {extra!r} in pyproject.toml"


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for entry in ("**/.venv", "**/.cache", ".git"):
        assert entry in ignored


# -- compose -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    (doc,) = load_yaml_docs(DEPLOY / "compose.yaml")
    return doc


def test_compose_teacher_matches_the_server(
    compose: dict[str, Any], dockerfile: dict[str, list[str]]
) -> None:
    teacher = compose["services"]["teacher"]
    assert "entrypoint" not in teacher, "the image's ENTRYPOINT is teacher-server serve"
    (entry,) = dockerfile["ENTRYPOINT"]
    args = parse_serve([*exec_form(entry)[1:], *teacher["command"]])
    container_ports = {int(p.rsplit(":", 1)[1]) for p in teacher["ports"]}
    assert container_ports == {args.port, args.http_port}
    assert set(teacher["environment"]) == {cli.TOKEN_ENV}
    assert (
        duration_seconds(teacher["stop_grace_period"]) >= args.drain_timeout_s + SHUTDOWN_MARGIN_S
    )
    port, path = url_in(teacher["healthcheck"]["test"])
    assert (port, path) == (args.http_port, "/readyz")
    assert path in http_routes()
    devices = teacher["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)


def test_compose_build_step_writes_the_served_model(compose: dict[str, Any]) -> None:
    from examples.teacher_pretrain import build_parser as pretrain_parser

    build = compose["services"]["teacher-build"]
    assert build["entrypoint"] == ["python3", "-m", "examples.teacher_pretrain"]
    built = pretrain_parser().parse_args(build["command"])
    teacher = compose["services"]["teacher"]
    served = parse_serve(["serve", *teacher["command"]])
    assert str(built.out) == served.model
    assert teacher["depends_on"]["teacher-build"]["condition"] == "service_completed_successfully"
    volume_of = {v.split(":")[1]: v.split(":")[0] for v in build["volumes"]}
    teacher_volumes = {v.split(":")[1]: v.split(":")[0] for v in teacher["volumes"]}
    mount = next(m for m in volume_of if served.model.startswith(m + "/"))
    assert teacher_volumes[mount] == volume_of[mount], "build and serve must share the volume"


def test_compose_student_targets_the_teacher(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from examples.distill import build_parser as distill_parser

    student = compose["services"]["student"]
    teacher = compose["services"]["teacher"]
    served = parse_serve(["serve", *teacher["command"]])
    assert student["entrypoint"] == ["python3", "-m", "examples.distill"]
    args = distill_parser().parse_args(student["command"])
    host, _, port = args.teacher.rpartition(":")
    assert host == "teacher" and int(port) == served.port
    assert student["depends_on"]["teacher"]["condition"] == "service_healthy"
    # The same token as the teacher, in the variable both read (empty: none); not on the
    # command line, where `ps` would show it.
    assert "--token" not in student["command"]
    assert student["environment"][cli.TOKEN_ENV] == f"${{{cli.TOKEN_ENV}:-}}"
    assert teacher["environment"][cli.TOKEN_ENV] == student["environment"][cli.TOKEN_ENV]
    monkeypatch.setenv(cli.TOKEN_ENV, "from-the-environment")
    assert distill_parser().parse_args(student["command"]).token == "from-the-environment"
    # The student reads the served teacher's weights for its full-vocabulary evaluation.
    assert str(args.teacher_dir) == served.model
    mounts = {v.split(":")[1]: v.split(":")[0] for v in student["volumes"]}
    teacher_mounts = {v.split(":")[1]: v.split(":")[0] for v in teacher["volumes"]}
    mount = next(m for m in teacher_mounts if served.model.startswith(m + "/"))
    assert mounts[mount] == teacher_mounts[mount]
    assert str(args.out).startswith(tuple(m + "/" for m in mounts))


# -- Kubernetes ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployment() -> dict[str, Any]:
    (doc,) = load_yaml_docs(DEPLOY / "k8s" / "teacher-deployment.yaml")
    assert doc["kind"] == "Deployment" and doc["apiVersion"] == "apps/v1"
    return doc


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    docs = load_yaml_docs(DEPLOY / "k8s" / "teacher-service.yaml")
    assert all(d["kind"] == "Service" for d in docs)
    return {d["metadata"]["name"]: d for d in docs}


def teacher_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def container_args(container: dict[str, Any]) -> argparse.Namespace:
    command = container.get("command", ["teacher-server", "serve"])
    assert command[:2] == ["teacher-server", "serve"], f"unexpected command {command}"
    return parse_serve([*command[1:], *container["args"]])


def named_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in container["ports"]}


def test_k8s_container_args_and_ports(deployment: dict[str, Any]) -> None:
    container = teacher_container(deployment)
    args = container_args(container)
    ports = named_ports(container)
    assert ports == {"grpc": args.port, "http": args.http_port}
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= 1
    assert gpus == (args.tensor_parallel_size or 1), "one GPU per tensor-parallel rank"


def test_k8s_probes_hit_real_routes(deployment: dict[str, Any]) -> None:
    container = teacher_container(deployment)
    routes = http_routes()
    ports = named_ports(container)
    args = container_args(container)
    expected = {"readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    for probe, path in expected.items():
        get = container[probe]["httpGet"]
        assert get["path"] == path and path in routes
        port = get["port"]
        assert (ports[port] if isinstance(port, str) else int(port)) == args.http_port
    startup = container["startupProbe"]["httpGet"]
    assert startup["path"] in routes


def test_k8s_token_from_secret(deployment: dict[str, Any]) -> None:
    env = {e["name"]: e for e in teacher_container(deployment)["env"]}
    assert cli.TOKEN_ENV in env
    ref = env[cli.TOKEN_ENV]["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"]
    assert "value" not in env[cli.TOKEN_ENV], "never put the token in the manifest"


def test_k8s_grace_period_outlasts_draining(deployment: dict[str, Any]) -> None:
    spec = deployment["spec"]["template"]["spec"]
    container = teacher_container(deployment)
    drain = container_args(container).drain_timeout_s
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
    sleep = float(pre_stop["command"][1]) if pre_stop.get("command", [""])[0] == "sleep" else 0.0
    # The server exits within --drain-timeout-s + SHUTDOWN_MARGIN_S of SIGTERM
    # (tests/teacher_server/grpc_api/test_auth_tls_drain.py checks that on a real server).
    assert spec["terminationGracePeriodSeconds"] >= sleep + drain + SHUTDOWN_MARGIN_S


def test_k8s_selector_matches_pod_labels(deployment: dict[str, Any]) -> None:
    selector = deployment["spec"]["selector"]["matchLabels"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()


def test_k8s_headless_service_targets_grpc(
    deployment: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    headless = services["teacher"]
    spec = headless["spec"]
    assert spec["clusterIP"] == "None"
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"].items() <= pod_labels.items()
    container = teacher_container(deployment)
    args = container_args(container)
    (port,) = spec["ports"]
    target = port["targetPort"]
    assert (named_ports(container)[target] if isinstance(target, str) else target) == args.port
    assert port["port"] == args.port, "clients dial the pod's own port through headless DNS"
    assert not spec.get("publishNotReadyAddresses", False), "only ready pods may get traffic"


def test_k8s_http_service_targets_http(
    deployment: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    spec = services["teacher-http"]["spec"]
    container = teacher_container(deployment)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"].items() <= pod_labels.items()
    (port,) = spec["ports"]
    target = port["targetPort"]
    http_port = container_args(container).http_port
    assert (named_ports(container)[target] if isinstance(target, str) else target) == http_port


# -- the recording Job ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def record_job() -> dict[str, Any]:
    (doc,) = load_yaml_docs(DEPLOY / "k8s" / "record-job.yaml")
    assert doc["kind"] == "Job" and doc["apiVersion"] == "batch/v1"
    return doc


def recorder_container(job: dict[str, Any]) -> dict[str, Any]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def parse_record(argv: list[str]) -> argparse.Namespace:
    """``teacher-record ARGV`` with the real parser: unknown flags and abbreviations fail."""
    from student_client.offline import record_cli

    parser = record_cli.build_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    written = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    assert written <= flags, f"not teacher-record flags: {sorted(written - flags)}"
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"teacher-record rejects {argv}: exit {e.code}")


def test_record_job_is_indexed_and_its_args_parse(record_job: dict[str, Any]) -> None:
    spec = record_job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    container = recorder_container(record_job)
    assert container["command"] == ["teacher-record"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["teacher-record"] == "student_client.offline.record_cli:main"
    args = parse_record(container["args"])
    assert args.output.startswith("s3://") and args.input.startswith("s3://")
    assert args.quiet
    assert args.shard_index is None and args.num_shards is None, "the Job sets them by env"


def test_record_job_env_names_are_the_clis(
    record_job: dict[str, Any], deployment: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from student_client.offline import record_cli

    spec = record_job["spec"]
    container = recorder_container(record_job)
    env = {e["name"]: e for e in container["env"]}
    # Kubernetes sets the index in every pod of an Indexed Job; the CLI reads that name.
    assert record_cli.SHARD_INDEX_ENV == "JOB_COMPLETION_INDEX"
    assert record_cli.SHARD_INDEX_ENV not in env
    assert int(env[record_cli.NUM_SHARDS_ENV]["value"]) == spec["completions"]
    assert spec["parallelism"] <= spec["completions"]
    # The token: the CLI's variable is the server's, from the teacher's own Secret.
    assert record_cli.TOKEN_ENV == cli.TOKEN_ENV
    ref = env[record_cli.TOKEN_ENV]["valueFrom"]["secretKeyRef"]
    teacher_env = {e["name"]: e for e in teacher_container(deployment)["env"]}
    assert ref == teacher_env[cli.TOKEN_ENV]["valueFrom"]["secretKeyRef"]
    # Object-store credentials from a Secret, in the variables pyarrow's S3 client reads.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "secretKeyRef" in env[name]["valueFrom"] and "value" not in env[name]
    # In a pod with index 5, the CLI records shard 5 of `completions`, with the token.
    for name, e in env.items():
        monkeypatch.setenv(name, e.get("value", f"secret-{name}"))
    monkeypatch.setenv(record_cli.SHARD_INDEX_ENV, "5")
    args = record_cli.build_parser().parse_args(container["args"])
    assert record_cli._shard(args) == (5, spec["completions"])
    assert args.token == f"secret-{record_cli.TOKEN_ENV}"


def test_record_job_targets_the_teacher_service(
    record_job: dict[str, Any], deployment: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    args = parse_record(recorder_container(record_job)["args"])
    (target,) = args.teacher
    assert target.startswith("dns:///"), "every replica, through the headless Service's DNS"
    host, _, port = target.removeprefix("dns:///").rpartition(":")
    assert host.split(".")[0] == "teacher" and services["teacher"]["spec"]["clusterIP"] == "None"
    assert int(port) == container_args(teacher_container(deployment)).port
    image = recorder_container(record_job)["image"]
    assert image == teacher_container(deployment)["image"], "the image has teacher-record too"
