"""Teachers and recording on a Ray cluster (the ``ray`` extra; docs/ray.md).

- :class:`TeacherPool` (``pool.py``): N ``teacher-server`` replicas as Ray actors, each
  serving its own gRPC port that students connect to directly; Ray restarts a replica
  whose process dies, and it comes back on the same address.
- ``python -m topk_ray pool`` (``cli.py``): the pool from the command line.

Only this package imports ``ray`` (an import contract in ``pyproject.toml``): the student
side, the server and the protocol run without it.
"""

from __future__ import annotations

from topk_ray.pool import PoolConfig, PoolError, TeacherPool, connect

__all__ = ["PoolConfig", "PoolError", "TeacherPool", "connect"]
