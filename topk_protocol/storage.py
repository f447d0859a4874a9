"""Where recordings and inputs live: a local path or any URI pyarrow's filesystems know.

One function turns a user's ``--input`` / ``--output`` / dataset path into a
``(pyarrow.fs.FileSystem, path)`` pair, so every reader and writer of the project opens
``s3://``, ``gs://``, ``hdfs://`` and local paths the same way (pyarrow.fs is the
well-kept layer for this; no hand-written client). :class:`Location` is that pair with
the few operations a recording needs (list, read, write whole, open).

Object storage settings come from the environment pyarrow reads (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, ...) or the
URI's query string (``s3://bucket/prefix?endpoint_override=host:port&scheme=http``).
An unreachable endpoint fails within seconds (pyarrow's S3 default: a 1 s connect
timeout and 3 attempts), never after minutes of retries.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

__all__ = ["Location", "StorageError", "is_uri", "join", "location", "resolve"]


class StorageError(OSError):
    """A location could not be reached or read (no such bucket, an unreachable endpoint,
    refused credentials): the message names the location and what the store said."""


def is_uri(location: str | os.PathLike[str]) -> bool:
    """True when ``location`` names a filesystem scheme (``s3://...``), False for a path."""
    return "://" in os.fspath(location)


def resolve(location: str | os.PathLike[str]) -> tuple[pafs.FileSystem, str]:
    """The filesystem and the path inside it of ``location`` (a local path or a URI).

    Local paths are made absolute and use ``pyarrow.fs.LocalFileSystem``; URIs go through
    ``pyarrow.fs.FileSystem.from_uri`` (credentials and endpoints from the environment
    pyarrow reads, e.g. ``AWS_ENDPOINT_URL``, or the URI's query string). A URI pyarrow
    cannot parse raises :class:`StorageError` naming it.
    """
    text = os.fspath(location)
    if not is_uri(text):
        return pafs.LocalFileSystem(), os.path.abspath(text)
    try:
        return pafs.FileSystem.from_uri(text)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise StorageError(f"{text}: {e}") from None


def location(value: str | os.PathLike[str]) -> str | Path:
    """A user's location as the project passes it around: a ``Path`` for a local path,
    the URI string unchanged for a URI (``Path`` would fold its ``//``)."""
    text = os.fspath(value)
    return text if is_uri(text) else Path(text)


def join(base: str | os.PathLike[str], *names: str) -> str | Path:
    """``base`` / ``names`` for a local path or a URI (the names go before a URI's query
    string, which carries the store's settings)."""
    text = os.fspath(base)
    if not is_uri(text):
        return Path(text, *names)
    head, sep, query = text.partition("?")
    return posixpath.join(head, *names) + sep + query


@dataclass(frozen=True)
class Location:
    """A file or directory on a pyarrow filesystem: ``fs`` and the ``path`` inside it.

    ``str()`` is what messages show: the local path, or ``scheme://path`` of a store.
    """

    fs: pafs.FileSystem
    path: str

    @classmethod
    def of(cls, value: str | os.PathLike[str] | Location) -> Location:
        """The location of a local path, a URI, or a :class:`Location` (unchanged)."""
        if isinstance(value, Location):
            return value
        return cls(*resolve(value))

    @property
    def local(self) -> bool:
        """Whether this is a local file (appended to in place, memory-mappable); any other
        filesystem is written one whole object at a time."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    def child(self, name: str) -> Location:
        return Location(self.fs, posixpath.join(self.path, name))

    def __str__(self) -> str:
        return self.path if self.local else f"{self.fs.type_name}://{self.path}"

    def __fspath__(self) -> str:
        return str(self)

    def _failed(self, doing: str, e: BaseException) -> StorageError:
        return StorageError(f"{self}: {doing} failed: {e}")

    def info(self) -> pafs.FileInfo:
        try:
            return self.fs.get_file_info(self.path)
        except OSError as e:
            raise self._failed("looking it up", e) from None

    def is_file(self) -> bool:
        return self.info().type == pafs.FileType.File

    def size(self) -> int:
        return int(self.info().size or 0)

    def files(self, suffix: str) -> list[tuple[Location, int]]:
        """``(file, size in bytes)`` of the files directly inside this directory whose
        names end with ``suffix``, by name; none when the directory does not exist."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        except OSError as e:
            raise self._failed("listing it", e) from None
        return sorted(
            (
                (Location(self.fs, i.path), int(i.size or 0))
                for i in infos
                if i.type == pafs.FileType.File and i.base_name.endswith(suffix)
            ),
            key=lambda item: item[0].name,
        )

    def make_dir(self) -> None:
        """Create the directory (and its parents); on an object store, check the bucket
        answers (an object store has no directories to create)."""
        try:
            if self.local:
                self.fs.create_dir(self.path, recursive=True)
            else:
                bucket = self.path.split("/", 1)[0]
                if self.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                    raise FileNotFoundError(f"bucket {bucket!r} does not exist")
        except OSError as e:
            raise self._failed("creating it", e) from None

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as f:
            return bytes(f.read())

    def write_bytes_atomic(self, data: bytes | pa.Buffer) -> None:
        """Write ``data`` so a reader sees the old contents or all of the new: a local file
        through a renamed temporary one; an object store publishes an object whole when
        its upload completes."""
        try:
            if not self.local:
                with self.fs.open_output_stream(self.path) as f:
                    f.write(data)
                return
            tmp = self.path + f".{uuid.uuid4().hex[:8]}.tmp"
            tmp = posixpath.join(posixpath.dirname(tmp), "." + posixpath.basename(tmp))
            with self.fs.open_output_stream(tmp) as f:
                f.write(data)
            self.fs.move(tmp, self.path)
        except OSError as e:
            raise self._failed("writing it", e) from None

    def open_input_file(self) -> Any:
        """A random-access file (``read_at``: ranged reads on an object store)."""
        return self.fs.open_input_file(self.path)

    def open_input_stream(self, buffer_size: int) -> Any:
        """A sequential stream read ahead ``buffer_size`` bytes at a time."""
        return self.fs.open_input_stream(self.path, buffer_size=buffer_size)

    def open_output_stream(self) -> Any:
        return self.fs.open_output_stream(self.path)
