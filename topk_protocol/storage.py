"""Where recordings and inputs live: a local path or any URI pyarrow's filesystems know.

One function turns a user's ``--input`` / ``--output`` / dataset path into a
``(pyarrow.fs.FileSystem, path)`` pair, so every reader and writer of the project opens
``s3://``, ``gs://``, ``hdfs://`` and local paths the same way (pyarrow.fs is the
well-kept layer for this; no hand-written client).
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs

__all__ = ["is_uri", "resolve"]


def is_uri(location: str | os.PathLike[str]) -> bool:
    """True when ``location`` names a filesystem scheme (``s3://...``), False for a path."""
    return "://" in os.fspath(location)


def resolve(location: str | os.PathLike[str]) -> tuple[pafs.FileSystem, str]:
    """The filesystem and the path inside it of ``location`` (a local path or a URI).

    Local paths are made absolute and use ``pyarrow.fs.LocalFileSystem``; URIs go through
    ``pyarrow.fs.FileSystem.from_uri`` (credentials and endpoints from the environment
    pyarrow reads, e.g. ``AWS_ENDPOINT_URL``, or the URI's query string).
    """
    text = os.fspath(location)
    if not is_uri(text):
        return pafs.LocalFileSystem(), os.path.abspath(text)
    return pafs.FileSystem.from_uri(text)
