"""Teachers and recording on a Ray cluster (the ``ray`` extra; docs/ray.md).

- :class:`TeacherPool` (``pool.py``): N ``teacher-server`` replicas as Ray actors, each
  serving its own gRPC port that students connect to directly; Ray restarts a replica
  whose process dies, and it comes back on the same address.
- :class:`PoolResolver` (``pool_registry.py``): the targets of a pool's replicas serving now,
  following it as replicas leave, come back or move; readable from any process of the
  cluster (a Ray task, another job) by the pool's name.
- ``record_on_ray`` (``record.py``): the sharded ``teacher-record`` as Ray tasks, local or
  ``s3://`` output; ``TeacherPayloads`` (``data.py``): a Ray Data stage.
- ``topk-ray pool | targets | record`` (``ray_cli.py``): the same from the command line.

Only this package imports ``ray`` (an import contract in ``pyproject.toml``): the student
side, the server and the protocol run without it.
"""

from __future__ import annotations

from topk_ray.pool import PoolConfig, TeacherPool, connect
from topk_ray.pool_errors import PoolError
from topk_ray.pool_registry import PoolResolver

__all__ = ["PoolConfig", "PoolError", "PoolResolver", "TeacherPool", "connect"]
