"""A recording written by N recorders: one part per shard of the input, read as one.

Layout (``N > 1``; with ``N = 1`` the recording is ``DIR`` itself, as one recorder
always wrote it)::

    DIR/part-00000-of-00004/      a recording (or a multi-teacher recording), rows of the
    DIR/part-00001-of-00004/      shard's input rows in input order
    ...
    DIR/part-0000I-of-0000N/part.json   written when shard I has recorded all its rows

The parts' rows in part order are the input's rows in input order (each shard is a
contiguous range of the input). ``part.json`` (:data:`PART_FILE`) is the part's completion
record: which units of which input it covers and how many rows it recorded; a part
without it is not finished.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from topk_protocol import storage
from topk_protocol.recording.format import METADATA_FILE
from topk_protocol.recording.multi_recording import MANIFEST_FILE
from topk_protocol.storage import resolve

__all__ = [
    "PART_FILE",
    "PART_FORMAT",
    "Part",
    "delete_part_file",
    "holds_recording",
    "join",
    "list_parts",
    "part_location",
    "part_name",
    "read_part_file",
    "write_part_file",
]

PART_FILE = "part.json"
PART_FORMAT = "topk-distill-part"
_PART_NAME = re.compile(r"^part-(\d{5})-of-(\d{5})$")


@dataclass(frozen=True)
class Part:
    """One part directory: shard ``index`` of ``num_shards``, at ``location``."""

    index: int
    num_shards: int
    location: str

    @property
    def name(self) -> str:
        return os.path.basename(self.location.rstrip("/"))


def part_name(index: int, num_shards: int) -> str:
    """``part-IIIII-of-NNNNN``."""
    return f"part-{index:05d}-of-{num_shards:05d}"


def join(location: str | os.PathLike[str], name: str) -> str:
    """``location/name`` for a path or a URI, as a string (:func:`topk_protocol.storage.join`)."""
    return os.fspath(storage.join(location, name))


def part_location(root: str | os.PathLike[str], index: int, num_shards: int) -> str:
    """Where shard ``index`` of ``num_shards`` writes: ``root`` itself when
    ``num_shards`` is 1, else ``root/part-...``."""
    return os.fspath(root) if num_shards == 1 else join(root, part_name(index, num_shards))


def list_parts(root: str | os.PathLike[str]) -> list[Part]:
    """The part directories under ``root``, by (shard count, index)."""
    fs, path = resolve(root)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except (OSError, ValueError):
        return []
    parts = []
    for info in infos:
        m = _PART_NAME.match(info.base_name)
        if m and info.type == pafs.FileType.Directory:
            parts.append(Part(int(m[1]), int(m[2]), join(root, info.base_name)))
    return sorted(parts, key=lambda p: (p.num_shards, p.index))


def holds_recording(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` itself is a recording (single- or multi-teacher)."""
    for name in (METADATA_FILE, MANIFEST_FILE):
        fs, path = resolve(join(location, name))
        if fs.get_file_info(path).type == pafs.FileType.File:
            return True
    return False


def read_part_file(location: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The part's ``part.json``, or None when it has none (the part is not finished)."""
    fs, path = resolve(join(location, PART_FILE))
    try:
        with fs.open_input_stream(path) as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return None
    if not isinstance(data, dict) or data.get("format") != PART_FORMAT:
        raise ValueError(f"{join(location, PART_FILE)}: not a {PART_FORMAT} record")
    return data


def write_part_file(location: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write ``part.json`` whole or not at all: a renamed temporary file on a local disk
    (an object store's put is atomic already)."""
    fs, path = resolve(join(location, PART_FILE))
    body = (json.dumps({"format": PART_FORMAT, **data}, indent=2, sort_keys=True) + "\n").encode()
    target = path
    fs.create_dir(os.path.dirname(path), recursive=True)  # a part of no rows has no recording
    if isinstance(fs, pafs.LocalFileSystem):
        target = f"{os.path.dirname(path)}/.{PART_FILE}.{uuid.uuid4().hex[:8]}.tmp"
    with fs.open_output_stream(target) as f:
        f.write(body)
    if target != path:
        fs.move(target, path)


def delete_part_file(location: str | os.PathLike[str]) -> None:
    """Remove ``part.json`` (a recorder starting on the part again: not finished)."""
    fs, path = resolve(join(location, PART_FILE))
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_file(path)
