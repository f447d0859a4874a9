"""``teacher-record --verify DIR``: is a (sharded) recording whole, before training starts?

Checks, naming the file of each problem:

- **one shard count**: every ``part-*-of-N`` directory has the same ``N`` (and no
  single-recorder recording sits next to them);
- **no gaps**: every shard ``0 <= I < N`` has its part, and each part has ``part.json``
  (its recorder finished); the parts' unit ranges are the shard rule's
  (:func:`~student_client.offline.inputs.shard_range`) and tile the same input's units;
- **counts**: each part holds the rows its ``part.json`` says it recorded;
- **checksums**: every row of every shard file verifies
  (:meth:`~topk_protocol.recording.RecordingReader.verify`), no batch is cut;
- **no duplicates**: no sequence is recorded twice in a part. A sequence that the input
  holds in two shards' ranges is recorded once in each; it is counted, not refused.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from student_client.offline.inputs import shard_range
from student_client.offline.recorder import recording_dirs
from topk_protocol import pb
from topk_protocol.errors import NotRecordedError, RecordingError
from topk_protocol.fingerprint import answer_problems
from topk_protocol.recording import RecordingReader
from topk_protocol.recording.sharded import (
    PART_FILE,
    Part,
    holds_recording,
    join,
    list_parts,
    part_name,
    read_part_file,
)

__all__ = ["Verdict", "verify", "verify_main"]


@dataclass
class Verdict:
    """What :func:`verify` found: ``problems`` (one line each, naming the file), and the
    totals of what it read."""

    problems: list[str] = field(default_factory=list)
    parts: int = 0
    rows: int = 0
    positions: int = 0
    cross_part_repeats: int = 0
    #: ``teacher (None: the one) -> [(recording location, its TeacherInfo)]``, each part's.
    teachers: dict[str | None, list[tuple[str, pb.TeacherInfo]]] = field(default_factory=dict)


def _parts(output: str, verdict: Verdict) -> list[Part]:
    """The parts of the shard count most parts have; the others are problems."""
    parts = list_parts(output)
    if not parts:
        if holds_recording(output):
            return [Part(0, 1, output)]
        verdict.problems.append(f"{output}: neither a recording nor part-*-of-* directories")
        return []
    counts = Counter(p.num_shards for p in parts)
    n = counts.most_common(1)[0][0]
    for p in parts:
        if p.num_shards != n:
            verdict.problems.append(
                f"{p.location}: written with another shard count ({p.num_shards}; the "
                f"other parts have {n})"
            )
    if holds_recording(output):
        verdict.problems.append(
            f"{output}: holds a recording of one shard next to parts of {n} shards"
        )
    ours = {p.index: p for p in parts if p.num_shards == n}
    for i in range(n):
        if i not in ours:
            verdict.problems.append(
                f"{join(output, part_name(i, n))}: missing (shard {i} of {n} has not recorded)"
            )
    return [ours[i] for i in sorted(ours)]


def _check_tiling(records: list[tuple[Part, dict[str, Any]]], verdict: Verdict) -> None:
    """Every finished part covers the shard rule's units of the same input."""
    first = records[0][1]
    for part, rec in records:
        where = join(part.location, PART_FILE)
        if (rec.get("shard_index"), rec.get("num_shards")) != (part.index, part.num_shards):
            verdict.problems.append(
                f"{where}: says shard {rec.get('shard_index')} of {rec.get('num_shards')}, "
                f"its directory {part.index} of {part.num_shards}"
            )
            continue
        for key in ("input", "num_units"):
            if rec.get(key) != first.get(key):
                verdict.problems.append(
                    f"{where}: {key} {rec.get(key)!r}, another part has {first.get(key)!r}"
                )
        want = shard_range(int(rec.get("num_units", 0)), part.index, part.num_shards)
        if rec.get("units") != [want.start, want.stop]:
            verdict.problems.append(
                f"{where}: units {rec.get('units')}, the shard's are "
                f"[{want.start}, {want.stop}) (a gap or an overlap)"
            )


def _check_part(part: Part, verdict: Verdict, seen: dict[bytes, str]) -> int:
    """Read every row of a part's recordings; returns the rows."""
    rows = 0
    if part.num_shards > 1 and not holds_recording(part.location):
        return 0  # a shard of no input rows: its part.json says 0
    for teacher, location in recording_dirs(part.location):
        if teacher is not None and not holds_recording(location):
            continue  # a teacher with no rows in this part
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                reader = RecordingReader(location)
        except RecordingError as e:
            verdict.problems.append(str(e))
            continue
        with reader:
            verdict.teachers.setdefault(teacher, []).append((location, reader.info))
            damaged = {str(e) for e in reader.damaged}
            verdict.problems.extend(str(e) for e in reader.verify())
            verdict.problems.extend(
                f"{line} (re-run shard {part.index} to seal it)"
                for line in reader.skipped
                if line not in damaged
            )
            keys = Counter(reader.key(i) for i in range(len(reader)))
            twice = sum(1 for c in keys.values() if c > 1)
            if twice:
                verdict.problems.append(f"{location}: {twice} sequences recorded more than once")
            suffix = (teacher or "").encode()
            for key in keys:
                if seen.setdefault(key + suffix, part.location) != part.location:
                    verdict.cross_part_repeats += 1
            rows += len(reader)
            verdict.positions += reader.num_positions
    return rows


def verify(output: str) -> Verdict:
    """Check the recording at ``output`` (a path or URI): see the module's list."""
    verdict = Verdict()
    parts = _parts(output, verdict)
    verdict.parts = len(parts)
    seen: dict[bytes, str] = {}
    records = []
    for part in parts:
        unreadable = False
        try:
            rec = read_part_file(part.location)
        except ValueError as e:  # not JSON, or not a part record
            verdict.problems.append(f"{join(part.location, PART_FILE)}: unreadable ({e})")
            rec, unreadable = None, True
        rows = _check_part(part, verdict, seen)
        verdict.rows += rows
        if rec is None:
            if not unreadable:
                verdict.problems.append(
                    f"{join(part.location, PART_FILE)}: missing (shard {part.index}'s recorder "
                    "has not finished: re-run it)"
                )
            continue
        records.append((part, rec))
        if rec.get("rows") != rows:
            verdict.problems.append(
                f"{part.location}: holds {rows} rows, its {PART_FILE} says {rec.get('rows')}"
            )
    if records:
        _check_tiling(records, verdict)
    for parts_of_teacher in verdict.teachers.values():
        verdict.problems.extend(_answer_problems(parts_of_teacher))
    return verdict


def verify_main(output: str) -> int:
    """The ``--verify`` command: problems on stderr and exit 1, or one line and 0."""
    verdict = verify(output)
    for line in verdict.problems:
        print(f"teacher-record --verify: {line}", file=sys.stderr)
    if verdict.problems:
        print(
            f"teacher-record --verify: {output}: {len(verdict.problems)} problem(s)",
            file=sys.stderr,
        )
        return 1
    print(
        f"teacher-record --verify: {output}: OK: {verdict.parts} part(s), {verdict.rows} rows, "
        f"{verdict.positions} positions; {verdict.cross_part_repeats} sequences repeated "
        "across parts"
    )
    return 0


def check_same_answers(parts: list[tuple[str, pb.TeacherInfo]]) -> None:
    """Refuse parts of one recording whose teachers' answer fingerprints disagree
    (:mod:`topk_protocol.fingerprint`): :class:`NotRecordedError` naming both parts."""
    problems = _answer_problems(parts)
    if problems:
        raise NotRecordedError("; ".join(problems))


def _answer_problems(parts: list[tuple[str, pb.TeacherInfo]]) -> list[str]:
    """One line per part whose teacher answers unlike the first part's."""
    if not parts:
        return []
    first, ref = parts[0]
    return [
        f"{where}: " + "; ".join(found)
        for where, info in parts[1:]
        for found in [answer_problems(info, ref, f"the teacher of {first}")]
        if found
    ]
