"""A pool's live targets, kept where any process of the cluster can read them.

- :class:`PoolRegistry`: one small named Ray actor per pool (namespace
  :data:`NAMESPACE`, name ``pool:NAME``). Each replica writes its target there when its
  server becomes ready, again after Ray restarts it (from whatever node it runs on now);
  the pool takes a replica out *before* it drains on scale-down, so nobody resolving
  afterwards picks a replica that is leaving.
- :class:`PoolResolver`: a picklable ``() -> list[str]`` that reads them. The same object
  serves a student (``TeacherClient(resolver())``), a Ray task (``record_on_ray`` resolves
  in every shard task as it starts, Ray's retries included) and a job that joined the
  cluster later and knows only the pool's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from topk_ray.pool_errors import PoolError

__all__ = ["NAMESPACE", "PoolRegistry", "PoolResolver", "create_registry", "registry_name"]

#: The Ray namespace of every pool's registry (pools are found by name across jobs).
NAMESPACE = "topk_ray"


def registry_name(pool: str) -> str:
    return f"pool:{pool}"


class PoolRegistry:
    """The actor's body: replica index -> ``host:port`` of the replicas serving now."""

    def __init__(self) -> None:
        self._targets: dict[int, str] = {}

    def set(self, index: int, target: str) -> None:
        self._targets[index] = target

    def remove(self, index: int) -> None:
        self._targets.pop(index, None)

    def targets(self) -> list[str]:
        """In replica order."""
        return [self._targets[i] for i in sorted(self._targets)]


def create_registry(pool: str) -> Any:
    """Start the registry actor of the pool named ``pool`` (:class:`PoolError` when a pool
    of that name already runs on this cluster)."""
    import ray

    name = registry_name(pool)
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise PoolError(f"name: a pool named {pool!r} already runs on this Ray cluster")
    actor: Any = (
        ray.remote(PoolRegistry)
        .options(name=name, namespace=NAMESPACE, num_cpus=0, max_concurrency=8)
        .remote()
    )
    ray.get(actor.targets.remote(), timeout=120)  # placed and answering
    return actor


@dataclass(frozen=True)
class PoolResolver:
    """``resolver()``: the gRPC targets of pool ``name``'s replicas serving now, in
    replica order (``ray`` must be initialised in the calling process: the driver, a Ray
    task or actor, or a job that ran ``topk_ray.connect(ADDRESS)``)."""

    name: str
    timeout_s: float = 60

    def __call__(self) -> list[str]:
        import ray

        try:
            actor = ray.get_actor(registry_name(self.name), namespace=NAMESPACE)
        except ValueError:
            raise PoolError(
                f"pool {self.name!r}: no pool of that name runs on this Ray cluster"
            ) from None
        return list(ray.get(actor.targets.remote(), timeout=self.timeout_s))
