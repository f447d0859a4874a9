"""A pool of teacher replicas on Ray (docs/ray.md).

    pool = TeacherPool(PoolConfig(["--backend", "vllm", "--model", M], replicas=4,
                                  num_gpus=2))   # 2 GPUs per replica: TP 2
    pool.start()                                 # placed, started, ready
    with TeacherClient(pool.targets()) as client: ...   # straight to the replicas
    pool.scale(2)                                # the last two drain, then leave
    pool.stop()

Every replica is a Ray actor (:class:`~topk_ray.replica.ReplicaProcess`) holding one
bundle of a placement group (``num_cpus`` / ``num_gpus`` each), serving its own gRPC
port: ``base_port + index`` (or free ports picked on a one-node cluster), the same after
Ray restarts it, so a client's target list stays valid while a replica comes back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from topk_ray.pool_errors import PoolError
from topk_ray.pool_registry import PoolResolver, create_registry, registry_name

__all__ = ["PoolConfig", "PoolError", "TeacherPool", "connect"]

log = logging.getLogger(__name__)


#: Tries to start a local cluster (:func:`connect` without an address).
_LOCAL_START_ATTEMPTS = 3


def _check_reachable(address: str, timeout_s: float) -> None:
    """Refuse an address where nothing listens (Ray itself would retry for minutes)."""
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise PoolError(f"ray address {address!r}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise PoolError(
            f"ray address {address!r}: no Ray cluster answers there ({e}); start one with "
            "`ray start --head` or give the head node's address"
        ) from None


def connect(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    connect_timeout_s: float = 5.0,
    **init_kwargs: Any,
) -> None:
    """``ray.init``: join the cluster at ``address`` (``HOST:PORT``, ``ray://HOST:PORT``
    or ``auto``), or start a local one of ``num_cpus`` CPUs when ``address`` is None.
    Raises :class:`PoolError` naming an address where no cluster answers. Nothing is
    done when Ray is already initialised."""
    import ray

    if address not in (None, "auto"):
        _check_reachable(address, connect_timeout_s)
    if ray.is_initialized():
        return
    init_kwargs.setdefault("include_dashboard", False)
    init_kwargs.setdefault("log_to_driver", False)
    if address is None:
        # The raylet waits for its agents' ports this long (Ray's default: 30 s, which a
        # loaded machine can miss); a value already in the environment wins.
        os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
        for attempt in range(_LOCAL_START_ATTEMPTS):
            try:
                ray.init(num_cpus=num_cpus, **init_kwargs)
                return
            except Exception as e:  # Ray raises a bare Exception for this
                # Ray waits a fixed 30 s for its raylet to register; a loaded machine
                # can take longer. Start again from nothing.
                if "timed out during startup" not in str(e) or attempt == _LOCAL_START_ATTEMPTS - 1:
                    raise
                log.warning("local Ray cluster: %s; starting it again", e)
                ray.shutdown()
    try:
        ray.init(address=address, **init_kwargs)
    except ConnectionError as e:
        hint = ""
        if os.environ.get("RAY_AUTH_MODE") != "token":
            hint = (
                "; a cluster with token authentication (a local one started by ray.init, by "
                "default) needs RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN, or "
                "~/.ray/auth_token) in this process's environment"
            )
        raise PoolError(f"ray address {address!r}: {e}{hint}") from None


@dataclass(frozen=True)
class PoolConfig:
    """One teacher's replicas: ``serve_args`` are ``teacher-server serve`` flags (the
    backend, model and limits; no ``--port`` / ``--http-port``: the pool sets them)."""

    serve_args: Sequence[str]
    replicas: int = 1
    name: str | None = None
    """the pool's name on the cluster, for :class:`~topk_ray.pool_registry.PoolResolver` from
    other jobs (None: a new unique one)"""
    num_cpus: float = 1
    """CPUs reserved per replica"""
    num_gpus: float = 0
    """GPUs per replica (the tensor-parallel size of a vLLM replica)"""
    strategy: str = "SPREAD"
    """placement group strategy: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD"""
    base_port: int | None = None
    """replica i serves gRPC on base_port + 2 i and HTTP on base_port + 2 i + 1 (None:
    free ports of this machine, for a one-node cluster)"""
    placement_timeout_s: float = 60
    """a placement group not placed within this is refused (too few resources)"""
    ready_timeout_s: float = 600
    """a replica not ready within this is refused (its log's tail in the error)"""
    drain_timeout_s: float = 30
    """scale-down: the drain budget of each replica removed"""
    log_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="topk-ray-pool-"))
    """where each replica writes its server's log (on its node)"""
    resources: dict[str, float] = field(default_factory=dict)
    """custom Ray resources per replica (e.g. an accelerator type)"""
    niceness: int = 0
    """the replica's nice value: Ray starts workers at 15 so that its own daemons stay
    responsive, and a server started there would inherit it and lose the CPU to any other
    process of the node; a replica is the node's main work"""

    def __post_init__(self) -> None:
        if self.name is not None and not self.name.strip():
            raise PoolError("name: must not be empty")
        if self.replicas < 1:
            raise PoolError(f"replicas: must be >= 1, got {self.replicas}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise PoolError("num_cpus/num_gpus: must be >= 0")
        for flag in ("--port", "--http-port", "--host"):
            if flag in self.serve_args:
                raise PoolError(f"serve_args: {flag} is set by the pool, per replica")
        _check_fingerprint_file(self.serve_args)

    def bundle(self) -> dict[str, float]:
        """One replica's resources."""
        out = {"CPU": float(self.num_cpus), **self.resources}
        if self.num_gpus:
            out["GPU"] = float(self.num_gpus)
        return out


def _check_fingerprint_file(serve_args: Sequence[str]) -> None:
    """A reference fingerprint this machine can read must parse before any replica is
    placed (one on the nodes only is read, and named, by each replica's server)."""
    from topk_protocol.fingerprint import FingerprintFileError, load_fingerprint

    flag = "--expect-fingerprint"
    for i, arg in enumerate(serve_args):
        if arg == flag and i + 1 < len(serve_args):
            path = serve_args[i + 1]
        elif arg.startswith(flag + "="):
            path = arg.split("=", 1)[1]
        else:
            continue
        if os.path.exists(path):
            try:
                load_fingerprint(path)
            except FingerprintFileError as e:
                raise PoolError(f"serve_args: --expect-fingerprint: {e}") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class TeacherPool:
    """The replicas of one teacher (several named teachers: several pools)."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.name = config.name or f"pool-{uuid.uuid4().hex[:12]}"
        self._registry: Any = None
        self._pg: Any = None
        self._actors: list[Any] = []
        self._ports: list[tuple[int, int]] = []

    # -- start and stop -------------------------------------------------------------------
    def start(self) -> TeacherPool:
        """Place, start and wait for every replica (:class:`PoolError` naming what
        failed: too few resources, or the replica and its log)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        cfg = self.config
        if not ray.is_initialized():
            connect()
        bundle = cfg.bundle()
        self._registry = create_registry(self.name)
        self._pg = placement_group([bundle] * cfg.replicas, strategy=cfg.strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=cfg.placement_timeout_s)
        if not ready:
            remove_placement_group(self._pg)
            self._pg = None
            self._drop_registry()
            raise PoolError(
                f"replicas: cannot place {cfg.replicas} x {bundle} ({cfg.strategy}) within "
                f"{cfg.placement_timeout_s:g} s; the cluster has {ray.cluster_resources()}, "
                f"{ray.available_resources()} free"
            )
        for i in range(cfg.replicas):
            self._actors.append(self._start_actor(i))
        self.wait_ready()
        log.info("pool ready: %s", ", ".join(self.targets()))
        return self

    def _start_actor(self, index: int) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from topk_ray.replica import ReplicaProcess

        cfg = self.config
        if cfg.base_port is not None:
            ports = (cfg.base_port + 2 * index, cfg.base_port + 2 * index + 1)
        else:
            ports = (_free_port(), _free_port())
        if index < len(self._ports):
            self._ports[index] = ports
        else:
            self._ports.append(ports)
        actor_cls = ray.remote(ReplicaProcess)
        return actor_cls.options(
            num_cpus=cfg.num_cpus,
            num_gpus=cfg.num_gpus,
            resources=cfg.resources or None,
            max_restarts=-1,
            max_concurrency=4,
            # Ray's own switch for a worker's nice value (its job supervisor uses it too).
            runtime_env={"env_vars": {"RAY_worker_niceness": str(cfg.niceness)}},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=index
            ),
        ).remote(index, list(cfg.serve_args), *ports, cfg.log_dir, registry_name(self.name))

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every replica is ready (a restarted one included)."""
        import ray

        timeout = self.config.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        for i, actor in enumerate(self._actors):
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PoolError(f"replica {i}: not ready within {timeout:g} s")
                try:
                    if ray.get(actor.wait_ready.remote(min(left, 30)), timeout=left + 30):
                        break
                    tail = ray.get(actor.log_tail.remote(), timeout=30)
                except ray.exceptions.RayActorError:
                    time.sleep(0.5)  # restarting
                    continue
                except ray.exceptions.GetTimeoutError:
                    continue
                if time.monotonic() >= deadline or not ray.get(actor.alive.remote()):
                    raise PoolError(f"replica {i}: its server did not start:\n{tail}")

    def stop(self) -> dict[int, int]:
        """Drain every replica, then remove the actors, the placement group and the
        pool's registry; each replica's server exit code (as :meth:`scale`)."""
        codes = self.scale(0)
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        self._drop_registry()
        return codes

    def _drop_registry(self) -> None:
        if self._registry is not None:
            import ray

            ray.kill(self._registry)
            self._registry = None

    def __enter__(self) -> TeacherPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- scaling ------------------------------------------------------------------------
    def scale(self, replicas: int) -> dict[int, int]:
        """Keep the first ``replicas`` (at most the placement group's size): the ones
        removed leave the resolver's targets, drain together (the server's own drain:
        NOT_SERVING, the requests in flight finish within ``drain_timeout_s``), then
        leave; ones added start and are waited for. Returns each removed replica's server
        exit code (0: it drained and exited by itself; -9: killed when the drain
        overran)."""
        import ray

        if replicas > self.config.replicas:
            raise PoolError(
                f"replicas: {replicas} exceeds the pool's placement group of "
                f"{self.config.replicas}; start another pool"
            )
        if replicas < 0:
            raise PoolError(f"replicas: must be >= 0, got {replicas}")
        codes: dict[int, int] = {}
        leaving = []  # every replica removed drains at once: one drain budget in all
        while len(self._actors) > replicas:
            actor = self._actors.pop()
            index = len(self._actors)
            if self._registry is not None:
                ray.get(self._registry.remove.remote(index), timeout=60)
            leaving.append((index, actor, actor.drain.remote(self.config.drain_timeout_s)))
        for index, actor, drained in leaving:
            with contextlib.suppress(ray.exceptions.RayError):  # already gone
                codes[index] = ray.get(drained, timeout=self.config.drain_timeout_s + 30)
            ray.kill(actor, no_restart=True)
        started = False
        while len(self._actors) < replicas:
            self._actors.append(self._start_actor(len(self._actors)))
            started = True
        if started:
            self.wait_ready()
        return codes

    # -- what students connect to --------------------------------------------------------------
    def addresses(self) -> list[tuple[str, int, int, int]]:
        """``(node ip, gRPC port, HTTP port, server pid)`` of each replica now."""
        import ray

        return list(ray.get([a.address.remote() for a in self._actors], timeout=60))

    def targets(self) -> list[str]:
        """The replicas' gRPC targets, ``ip:port``, for ``TeacherClient`` /
        ``MultiTeacherClient`` (the same after a replica restarts)."""
        return [f"{host}:{port}" for host, port, _, _ in self.addresses()]

    def resolver(self) -> PoolResolver:
        """A picklable ``() -> list[str]`` of the replicas serving now, that follows the
        pool as replicas leave (scale-down), come back (Ray restarts, scale-up) or move
        node; usable in Ray tasks and in other jobs on the cluster (by the pool's name)."""
        return PoolResolver(self.name)

    def client(self, **kwargs: Any) -> Any:
        """A ``TeacherClient`` over every replica (fail-over between them)."""
        from student_client import TeacherClient

        return TeacherClient(self.targets(), **kwargs)

    def replica_actor(self, index: int) -> Any:
        return self._actors[index]
