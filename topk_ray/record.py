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

__all__ = ["RecordError", "record_on_ray"]


class RecordError(RuntimeError):
    """A shard failed after its retries, or ``--verify`` found problems (named)."""


def _record_shard(
    argv: list[str], index: int, num_shards: int, on_start: Callable[[int, int], None] | None
) -> int:
    """One shard's recorder in this Ray worker; its exit code (``SystemExit`` kept)."""
    from student_client.offline.record_cli import main

    if on_start is not None:
        on_start(index, os.getpid())
    try:
        return main([*argv, "--shard-index", str(index), "--num-shards", str(num_shards)])
    except SystemExit as e:
        raise RecordError(f"shard {index} of {num_shards}: {e}") from None


def record_on_ray(
    targets: Sequence[str],
    input: str,
    output: str,
    *,
    num_shards: int,
    record_args: Sequence[str] = (),
    max_retries: int = 3,
    num_cpus: float = 1,
    on_start: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Record ``input`` into ``output`` with ``num_shards`` Ray tasks against the
    replicas ``targets`` (e.g. ``TeacherPool.targets()``); ``record_args`` are further
    ``teacher-record`` flags (``--top-k``, ``--dtype``, ``--batch-size``, ...).
    ``on_start(shard, worker pid)`` runs in each task as it starts (retries included).
    Returns ``--verify``'s problems (none: the recording is whole); raises
    :class:`RecordError` naming a shard that failed after its retries."""
    import ray

    if num_shards < 1:
        raise RecordError(f"num_shards: must be >= 1, got {num_shards}")
    if not targets:
        raise RecordError("targets: no replica to record from")
    argv = [
        "--teacher", ",".join(targets), "--input", input, "--output", output, "--quiet",
        *record_args,
    ]  # fmt: skip
    task = ray.remote(_record_shard).options(
        max_retries=max_retries, retry_exceptions=False, num_cpus=num_cpus
    )
    refs = [task.remote(argv, i, num_shards, on_start) for i in range(num_shards)]
    failures = []
    for i, ref in enumerate(refs):
        try:
            code = ray.get(ref)
            if code:
                failures.append(f"shard {i} of {num_shards}: exit code {code}")
        except ray.exceptions.RayError as e:
            failures.append(f"shard {i} of {num_shards}: {e}")
    if failures:
        raise RecordError("; ".join(failures) + f" (re-run to resume into {output})")
    from student_client.offline.verify import verify

    return list(verify(output).problems)
