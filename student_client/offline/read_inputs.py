"""Whole inputs in memory: every sequence (or teacher name, or candidate row) of an input.

For small corpora and tests; ``teacher-record`` itself streams its input a few rows at
a time (:mod:`student_client.offline.inputs`, which also lists the formats). A bad input
ends the program with ``teacher-record: <reason>``, as the command does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from student_client.offline.inputs import InputError, open_input

__all__ = ["read_candidate_column", "read_teacher_column", "read_token_sequences"]


def _read_all(
    path: str | Path,
    column: str | None,
    teacher_column: str | None = None,
    candidate_column: str | None = None,
) -> list[Any]:
    try:
        source = open_input(
            path, column, teacher_column=teacher_column, candidate_column=candidate_column
        )
        try:
            chunks = [c for _, c in source.read(range(source.num_units))]
        finally:
            source.close()
    except InputError as e:
        raise SystemExit(f"teacher-record: {e}") from None
    if teacher_column is not None:
        return [n for c in chunks for n in c.teachers or []]
    if candidate_column is not None:
        return [ids for c in chunks for ids in c.candidates or []]
    return [t for c in chunks for t in c.tokens]


def read_token_sequences(path: str | Path, column: str | None = None) -> list[np.ndarray]:
    """Every token-id sequence of an input (see the module's formats), in memory: for
    small corpora and tests; ``teacher-record`` streams instead (:mod:`.inputs`)."""
    return _read_all(path, column, None)


def read_teacher_column(path: str | Path, column: str) -> list[str]:
    """The teacher name of each sequence: column ``column`` of the same input."""
    return _read_all(path, None, teacher_column=column)


def read_candidate_column(
    path: str | Path, column: str, token_column: str | None = None
) -> list[np.ndarray]:
    """Each sequence's candidate ids ``[L, C]`` int32 (one list of C ids per token,
    ``-1`` padding): column ``column`` of the same input, in memory (as
    :func:`read_token_sequences`)."""
    return _read_all(path, token_column, candidate_column=column)
