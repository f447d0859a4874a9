"""deploy/kuberay/ agrees with the code it runs (no Kubernetes here: the files are parsed
and held against the real parsers, as tests/test_deploy.py does for deploy/k8s): the
RayJob's entrypoint is a ``topk-ray pool`` command the CLI accepts, its serve flags parse
with ``teacher-server``'s parser, every replica's ports are open in the worker pods, the
worker group has the GPUs and CPUs the replicas ask for, ``ray job stop`` leaves the pool
time to drain, and the image installs the ``ray`` extra."""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_deploy import dockerfile_instructions, load_yaml_docs, parse_serve

from teacher_server import cli as server_cli
from teacher_server.lifecycle import SHUTDOWN_MARGIN_S
from topk_ray.pool import PoolConfig
from topk_ray.ray_cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "deploy" / "kuberay"


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    (doc,) = load_yaml_docs(KUBERAY / "teacher-pool.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob"
    return doc


def _pool_args(job: dict[str, Any]) -> Any:
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "topk-ray"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["topk-ray"] == "topk_ray.ray_cli:main"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "pool" and args.address == "auto"
    return args


def _serve_args(args: Any) -> list[str]:
    serve = list(args.serve_args)
    return serve[1:] if serve[:1] == ["--"] else serve


def _worker(job: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    return group, container


def test_the_entrypoint_is_a_pool_the_cli_and_the_server_accept(job: dict[str, Any]) -> None:
    args = _pool_args(job)
    serve = _serve_args(args)
    PoolConfig(serve, replicas=args.replicas, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
               base_port=args.base_port)  # fmt: skip
    # The pool adds the ports; the rest must be teacher-server serve's flags.
    parse_serve(["serve", *serve, "--port", "1", "--http-port", "2"])
    assert args.name and args.base_port is not None, "named, on fixed ports (multi-node)"


def test_every_replicas_ports_are_open_in_the_worker_pods(job: dict[str, Any]) -> None:
    args = _pool_args(job)
    _, container = _worker(job)
    opened = {p["containerPort"] for p in container["ports"]}
    for i in range(args.replicas):
        # PoolConfig's rule: gRPC on base + 2i, HTTP on base + 2i + 1.
        assert {args.base_port + 2 * i, args.base_port + 2 * i + 1} <= opened


def test_the_worker_group_holds_the_replicas(job: dict[str, Any]) -> None:
    args = _pool_args(job)
    group, container = _worker(job)
    gpus = float(group["rayStartParams"]["num-gpus"])
    cpus = float(group["rayStartParams"]["num-cpus"])
    assert float(container["resources"]["limits"]["nvidia.com/gpu"]) == gpus
    assert float(container["resources"]["limits"]["cpu"]) >= cpus
    per_pod = min(gpus // args.num_gpus, cpus // args.num_cpus)  # SPREAD: one bundle each
    assert group["minReplicas"] * per_pod >= args.replicas
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "no replica lands on the head"


def test_stopping_the_job_leaves_time_to_drain(job: dict[str, Any]) -> None:
    args = _pool_args(job)
    drain = parse_serve(["serve", *_serve_args(args)]).drain_timeout_s
    (head,) = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in head["env"]}
    # Ray's job supervisor (on the head) SIGKILLs the driver this long after SIGTERM; the
    # pool drains all replicas at once, each within the drain budget plus its margin.
    assert float(env["RAY_JOB_STOP_WAIT_TIME_S"]) >= drain + SHUTDOWN_MARGIN_S


def test_the_token_and_the_targets_file(job: dict[str, Any]) -> None:
    args = _pool_args(job)
    _, container = _worker(job)
    env = {e["name"]: e for e in container["env"]}
    ref = env[server_cli.TOKEN_ENV]["valueFrom"]["secretKeyRef"]
    deployment = yaml.safe_load((ROOT / "deploy" / "k8s" / "teacher-deployment.yaml").read_text())
    (teacher,) = deployment["spec"]["template"]["spec"]["containers"]
    teacher_env = {e["name"]: e for e in teacher["env"]}
    assert ref == teacher_env[server_cli.TOKEN_ENV]["valueFrom"]["secretKeyRef"]
    # The driver (the RayJob's entrypoint) runs on the head: the file's folder is mounted.
    (head,) = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    mounts = [m["mountPath"] for m in head["volumeMounts"]]
    assert any(str(args.targets_file).startswith(m.rstrip("/") + "/") for m in mounts)


def test_the_image_adds_the_ray_extra(job: dict[str, Any]) -> None:
    steps = dockerfile_instructions(KUBERAY / "Dockerfile.ray")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert "ray" in extras
    assert any(k == "RUN" and 'pip install ".[ray]"' in v for k, v in steps)
    for k, v in steps:
        if k == "COPY":
            *sources, _ = shlex.split(v)
            assert all((ROOT / s).exists() for s in sources), v
    _, container = _worker(job)
    (head,) = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert container["image"] == head["image"] == "topk-distill-teacher-ray:latest"
