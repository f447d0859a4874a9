"""topk_protocol.storage: local paths and URIs resolve, join and display alike."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import pytest

from topk_protocol.storage import Location, StorageError, is_uri, join, location, resolve


def test_paths_stay_paths_and_uris_stay_strings(tmp_path: Path) -> None:
    assert location(tmp_path / "rec") == tmp_path / "rec" and not is_uri(tmp_path)
    assert location("s3://bkt/a/b") == "s3://bkt/a/b"  # a Path would fold the //
    assert join(tmp_path, "t1", "x") == tmp_path / "t1" / "x"
    assert join("s3://bkt/rec", "t1") == "s3://bkt/rec/t1"
    assert join("s3://bkt/rec?endpoint_override=h:9&scheme=http", "t1") == (
        "s3://bkt/rec/t1?endpoint_override=h:9&scheme=http"
    )


def test_a_location_lists_writes_and_names_itself(tmp_path: Path) -> None:
    loc = Location.of(tmp_path / "d")
    assert loc.local and str(loc) == str(tmp_path / "d") and loc.files(".arrow") == []
    loc.make_dir()
    loc.child("b.arrow").write_bytes_atomic(b"xy")
    loc.child("a.arrow").write_bytes_atomic(b"z")
    loc.child("c.json").write_bytes_atomic(b"{}")
    assert [(f.name, n) for f, n in loc.files(".arrow")] == [("a.arrow", 1), ("b.arrow", 2)]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["a.arrow", "b.arrow", "c.json"]
    assert Location(pafs.S3FileSystem(anonymous=True), "bkt/k").__str__() == "s3://bkt/k"


def test_a_uri_pyarrow_cannot_parse_is_named() -> None:
    with pytest.raises(StorageError, match="nosuchscheme://x"):
        resolve("nosuchscheme://x")
