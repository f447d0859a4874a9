"""Deprecated: the ``teacher-server`` entry point is :func:`teacher_server.__main__.main`."""

from __future__ import annotations

import warnings

from teacher_server.__main__ import SERVER_MODULES, main

__all__ = ["SERVER_MODULES", "main"]

warnings.warn(
    "teacher_server.entry is deprecated; the teacher-server entry point is "
    "teacher_server.__main__:main",
    DeprecationWarning,
    stacklevel=2,
)
