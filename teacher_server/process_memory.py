"""Resident memory of the server's process tree, by process and kind, read from ``/proc``.

The server and vLLM's engine-core and worker processes (its descendants) each hold three
kinds of resident memory (``RssAnon``, ``RssFile``, ``RssShmem`` of ``/proc/PID/status``):
``anonymous`` (what the process allocated: heaps, tensors, the KV cache), ``file`` (pages
of its libraries and files, bounded by their sizes, shared with any process that maps
them) and ``shared`` (shared memory: vLLM's message queues between its processes, which
both ends map, so a sum over processes counts them once per process). ``/metrics``
exports them (``topk_teacher_process_resident_bytes``, read at each scrape); what each
holds and its bound: docs/operations.md, "Memory over time". Linux only: elsewhere
nothing is reported.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["MEMORY_KINDS", "process_label", "resident_bytes", "tree_resident_bytes"]

#: ``/proc/PID/status`` field -> the ``kind`` label.
MEMORY_KINDS = {"RssAnon": "anonymous", "RssFile": "file", "RssShmem": "shared"}

#: vLLM's process titles (``/proc/PID/comm``, cut to 15 bytes) -> the ``process`` label.
_VLLM_PROCESSES = {"VLLM::EngineCor": "engine_core", "VLLM::Worker": "worker"}


def resident_bytes(pid: int) -> dict[str, int]:
    """The resident bytes of process ``pid`` by kind (:data:`MEMORY_KINDS`' labels);
    empty when the process is gone or ``/proc`` is missing."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in MEMORY_KINDS:
            out[MEMORY_KINDS[name]] = int(value.split()[0]) * 1024  # kB
    return out


def process_label(pid: int, root: int) -> str:
    """``server`` for ``root``, ``engine_core`` / ``worker`` for vLLM's processes (by
    their titles), ``other`` for any other descendant."""
    if pid == root:
        return "server"
    try:
        title = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "other"
    return next((label for t, label in _VLLM_PROCESSES.items() if title.startswith(t)), "other")


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (``/proc/PID/task/TID/children``)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            found.extend(int(child) for child in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return found


def tree_resident_bytes(root: int | None = None) -> dict[tuple[str, str], int]:
    """``{(process, kind): bytes}`` summed over ``root`` (default: this process) and every
    descendant, by :func:`process_label` and kind."""
    root = os.getpid() if root is None else root
    totals: dict[tuple[str, str], int] = {}
    pending, seen = [root], set()
    while pending:
        pid = pending.pop()
        if pid in seen:
            continue
        seen.add(pid)
        label = process_label(pid, root)
        for kind, value in resident_bytes(pid).items():
            totals[label, kind] = totals.get((label, kind), 0) + value
        pending.extend(_children(pid))
    return totals
