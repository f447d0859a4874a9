"""Multi-teacher recordings: one ordinary recording per named teacher, under one directory.

A multi-teacher run (``MultiTeacherClient(..., record_to=DIR)``) writes::

    DIR/teachers.json        {"format": "topk-distill-multi-teacher", "teachers": [names]}
    DIR/<name>/              an ordinary recording (topk_protocol.recording) of that teacher

Each row's teacher is the sub-directory it is in. Why not one recording with a teacher
column: the recording key is the sequence's tokens only, and the same sequence may be
scored by two teachers (two different answers); one directory per teacher keeps every
recording rule (keys, resume, dtype and K checks, crash safety) as it is, and a
sub-directory is a recording that every single-teacher tool (``ReplayClient``,
``PayloadDataset``, ``teacher-server serve --backend replay``) opens unchanged.

Teacher names are path components, so they are restricted to :data:`NAME_PATTERN`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from topk_protocol.errors import RecordingError
from topk_protocol.storage import Location, join

__all__ = [
    "MANIFEST_FILE",
    "MULTI_FORMAT_NAME",
    "NAME_PATTERN",
    "check_teacher_name",
    "read_manifest",
    "recorded_teachers",
    "teacher_recording_path",
    "write_manifest",
]

MANIFEST_FILE = "teachers.json"
MULTI_FORMAT_NAME = "topk-distill-multi-teacher"
#: A teacher name: 1-64 of letters, digits, ``_ . -``, not starting with ``.`` or ``-``.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


def check_teacher_name(name: object) -> str:
    """``name`` if it is a valid teacher name, else ValueError naming the rule."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ValueError(
            f"teacher name: {name!r} must be 1-64 letters, digits, '_', '.', '-' "
            "(not starting with '.' or '-')"
        )
    return name


def teacher_recording_path(root: str | os.PathLike[str], name: str) -> str | Path:
    """The recording directory of teacher ``name`` inside a multi-teacher recording (a
    ``Path``, or a URI string for a recording on another filesystem)."""
    return join(root, check_teacher_name(name))


def read_manifest(root: str | os.PathLike[str]) -> list[str] | None:
    """The teacher names of a multi-teacher recording, or None when ``root`` is not one."""
    path = Location.of(root).child(MANIFEST_FILE)
    try:
        if not path.is_file():
            return None
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise RecordingError(path, None, f"unreadable: {e}") from None
    if not isinstance(data, dict) or data.get("format") != MULTI_FORMAT_NAME:
        raise RecordingError(path, None, f"not a {MULTI_FORMAT_NAME!r} manifest")
    names = data.get("teachers")
    if not isinstance(names, list) or not names:
        raise RecordingError(path, None, "teachers: expected a non-empty list of names")
    return [check_teacher_name(n) for n in names]


def recorded_teachers(root: str | os.PathLike[str]) -> list[str]:
    """The teachers of a multi-teacher recording that have rows recorded (a teacher of
    the manifest that answered nothing yet has no recording directory)."""
    from topk_protocol.recording import METADATA_FILE

    names = read_manifest(root) or []
    base = Location.of(root)
    return [n for n in names if base.child(n).child(METADATA_FILE).is_file()]


def write_manifest(root: str | os.PathLike[str], names: Iterable[str]) -> None:
    """Create (or extend) the manifest of a multi-teacher recording at ``root``."""
    base = Location.of(root)
    base.make_dir()
    old = read_manifest(base) or []
    merged = old + [check_teacher_name(n) for n in names if n not in old]
    manifest = {"format": MULTI_FORMAT_NAME, "teachers": merged}
    base.child(MANIFEST_FILE).write_bytes_atomic((json.dumps(manifest, indent=2) + "\n").encode())
