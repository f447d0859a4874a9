"""``teacher-record`` on Ray: one task per shard against a pool's replicas (docs/ray.md).

Each task runs the sharded recorder for its shard (``--shard-index I --num-shards N``,
the same code as a Kubernetes Indexed Job's pods), writing its part of ``output`` (a path
on storage every node sees, or an ``s3://`` URI). A task whose worker dies is retried by
Ray (``max_retries``) and resumes its part as a re-run recorder does: the rows already
sealed stay, a shard cut mid-write is sealed at its last complete row. The driver then
runs ``--verify`` over the parts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["RecordError", "Targets", "record_on_ray"]


class RecordError(RuntimeError):
    """A shard failed after its retries, or ``--verify`` found problems (named)."""


#: What a shard task records from: fixed targets, or a resolver (e.g. ``pool.resolver()``)
#: called in the task as it starts, Ray's retries included.
Targets = Sequence[str] | Callable[[], Sequence[str]]


def _resolve(targets: Targets) -> list[str]:
    out = list(targets() if callable(targets) else targets)
    if not out:
        raise RecordError("targets: no replica to record from (the pool has none serving)")
    return out


def _record_shard(
    targets: Targets,
    argv: list[str],
    index: int,
    num_shards: int,
    on_start: Callable[[int, int, list[str]], None] | None,
) -> int:
    """One shard's recorder in this Ray worker; its exit code (``SystemExit`` kept)."""
    from student_client.offline.record_cli import main

    resolved = _resolve(targets)
    if on_start is not None:
        on_start(index, os.getpid(), resolved)
    shard = ["--shard-index", str(index), "--num-shards", str(num_shards)]
    try:
        return main(["--teacher", ",".join(resolved), *argv, *shard])
    except SystemExit as e:
        raise RecordError(f"shard {index} of {num_shards}: {e}") from None


def record_on_ray(
    targets: Targets,
    input: str,
    output: str,
    *,
    num_shards: int,
    record_args: Sequence[str] = (),
    max_retries: int = 3,
    num_cpus: float = 1,
    runtime_env: dict[str, Any] | None = None,
    on_start: Callable[[int, int, list[str]], None] | None = None,
) -> list[str]:
    """Record ``input`` into ``output`` (a path every node sees, or an ``s3://`` URI)
    with ``num_shards`` Ray tasks against a pool's replicas: ``targets`` is a list, or a
    resolver such as ``TeacherPool.resolver()`` that each task calls as it starts (a
    retried task gets the replicas serving then). ``record_args`` are further
    ``teacher-record`` flags (``--top-k``, ``--dtype``, ``--batch-size``, ...);
    ``runtime_env`` is the tasks' Ray runtime environment (e.g. ``{"env_vars": ...}`` with
    object-store credentials the nodes lack). ``on_start(shard, worker pid, targets)``
    runs in each task as it starts. Returns ``--verify``'s problems (none: the recording
    is whole); raises :class:`RecordError` naming a shard that failed after its retries."""
    import ray

    if num_shards < 1:
        raise RecordError(f"num_shards: must be >= 1, got {num_shards}")
    if not callable(targets):
        targets = _resolve(targets)
    argv = ["--input", input, "--output", output, "--quiet", *record_args]
    options: dict[str, Any] = {
        "max_retries": max_retries, "retry_exceptions": False, "num_cpus": num_cpus
    }  # fmt: skip
    if runtime_env is not None:
        options["runtime_env"] = runtime_env
    task = ray.remote(_record_shard).options(**options)
    refs = [task.remote(targets, argv, i, num_shards, on_start) for i in range(num_shards)]
    failures = []
    for i, ref in enumerate(refs):
        try:
            code = ray.get(ref)
            if code:
                failures.append(f"shard {i} of {num_shards}: exit code {code}")
        except ray.exceptions.RayTaskError as e:
            failures.append(str(e.cause) if isinstance(e.cause, RecordError) else f"{e}")
        except ray.exceptions.RayError as e:
            failures.append(f"shard {i} of {num_shards}: {e}")
    if failures:
        raise RecordError("; ".join(failures) + f" (re-run to resume into {output})")
    from student_client.offline.verify import verify

    return list(verify(output).problems)
