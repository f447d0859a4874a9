"""The recording format: file names, the Arrow schema, keys, dtypes and ``metadata.json``.

A recording is a directory::

    DIR/metadata.json          teacher info, temperature, recorded K and dtype, format version
    DIR/shard-<n>-<id>.arrow   Arrow IPC *stream* files, one per writer session

with one row per scored sequence:

============================  =========================================  ==================
column                        Arrow type                                 meaning
============================  =========================================  ==================
``key``                       ``binary`` (32 bytes)                      :func:`sequence_key`
``token_ids``                 ``list<int32>``                            ``[L]`` the sequence
``position_start``            ``int32``                                  first position
``position_end``              ``int32``                                  end (exclusive)
``ids``                       ``list<fixed_size_list<int32, K>>``        ``[S, K]`` top-k ids
``logprobs``                  ``list<fixed_size_list<F, K>>``            ``[S, K]`` sorted desc.
``sampled_logprobs``          ``list<F>``, null when not recorded        ``[S]``, NaN at L-1
``row_crc32``                 ``uint32``                                 the row's checksum
============================  =========================================  ==================

``S = position_end - position_start``; row ``j`` is position ``position_start + j``. ``F``
is ``float16`` for a float16 recording and ``float32`` for float32 and bfloat16 ones
(bfloat16 values widened to float32, which is exact). The columns from ``ids`` on are the
array fields of :class:`~topk_protocol.arrays.SequenceArrays`, in order
(:func:`recording_schema` derives them from it); an optional field's column may be
absent from a shard written before the field existed (its rows then have none).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from google.protobuf import json_format

from topk_protocol import (
    DEFAULT_TEACHER_TEMPERATURE,
    check_temperature,
    pb,
    teacher_temperature,
)
from topk_protocol.arrays import ARRAY_FIELDS, ArrayField, SequenceArrays
from topk_protocol.codec import _bf16_bits_to_f32, _f32_to_bf16_bits
from topk_protocol.errors import RecordingError
from topk_protocol.integrity import (
    CHECKSUM_COLUMN,
    CHECKSUM_NAME,
    FORMAT_FIELDS,
    SCHEMA_METADATA_KEY,
    format_disagreements,
    row_checksum,
    shard_format,
)

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_FLUSH_INTERVAL_S",
    "DTYPES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "READ_ERRORS",
    "SHARD_SUFFIX",
    "ShardCheck",
    "can_serve_dtype",
    "cast_arrays",
    "cast_like_teacher",
    "check_schema",
    "read_metadata",
    "recording_schema",
    "row_crc",
    "sequence_key",
    "shards",
    "storage_dtype",
    "write_json_atomic",
]

FORMAT_NAME = "topk-distill-payloads"
FORMAT_VERSION = 2  # 1 was the single-file ``.tkrec`` container
METADATA_FILE = "metadata.json"
SHARD_SUFFIX = ".arrow"
DEFAULT_FLUSH_INTERVAL_S = 2.0
COMPRESSIONS = ("zstd", "lz4", "none", "auto")  # auto: zstd
DTYPES = ("float32", "float16", "bfloat16")
#: What reading damaged Arrow bytes raises (ArrowInvalid and UnicodeDecodeError are
#: ValueErrors).
READ_ERRORS = (pa.ArrowException, OSError, ValueError)
_KEY_DOMAIN = b"topk-distill/sequence/v2"


def sequence_key(token_ids: bytes | npt.ArrayLike) -> bytes:
    """The key of a recorded sequence: sha256 of its int32 little-endian token ids (32 bytes).

    Only the tokens count: K, positions and dtype are columns of the row, so one recorded
    row answers every K' <= K, position sub-range and reproducible dtype.
    """
    if not isinstance(token_ids, bytes | bytearray | memoryview):
        token_ids = np.ascontiguousarray(token_ids, dtype="<i4").tobytes()
    return hashlib.sha256(_KEY_DOMAIN + bytes(token_ids)).digest()


def can_serve_dtype(recorded: str, wanted: str) -> bool:
    """Whether values recorded in ``recorded`` give exactly what the teacher sends in
    ``wanted``: the teacher computes float32 and casts once, so a float32 recording serves
    every dtype; a float16 or bfloat16 one only itself."""
    return recorded == "float32" or recorded == wanted


def storage_dtype(f: ArrayField, dtype: str) -> type[np.generic]:
    """The numpy dtype a ``dtype`` recording stores field ``f`` in: an integer field in its
    own dtype (int32 ids, uint8 sample counts), and float16 (a float16 recording) or
    float32 for log-probs."""
    if np.issubdtype(f.dtype, np.integer):
        return f.dtype
    return np.float16 if dtype == "float16" else np.float32


def _arrow_type(f: ArrayField, dtype: str, top_k: int) -> pa.DataType:
    value = pa.from_numpy_dtype(storage_dtype(f, dtype))
    return pa.list_(pa.list_(value, top_k) if f.columns else value)


def recording_schema(
    top_k: int,
    dtype: str,
    fmt: dict[str, Any] | None = None,
    *,
    checksums: bool = True,
    optional: tuple[str, ...] | None = None,
) -> pa.Schema:
    """The Arrow schema of a recording with ``top_k`` and log-prob ``dtype`` (name).

    ``fmt``: the other format fields the schema metadata repeats (``vocab_size``,
    ``tokenizer_fingerprint``, ``temperature``); ``checksums=False``: the columns of a
    shard written before the ``row_crc32`` column existed; ``optional``: the optional
    array fields that have a column (default: all of them).
    """
    fields = [
        pa.field("key", pa.binary(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("position_start", pa.int32(), nullable=False),
        pa.field("position_end", pa.int32(), nullable=False),
    ]
    for f in ARRAY_FIELDS:
        if f.optional and optional is not None and f.name not in optional:
            continue
        fields.append(pa.field(f.name, _arrow_type(f, dtype, top_k), nullable=f.optional))
    stated: dict[str, Any] = {"top_k": top_k, "dtype": dtype}
    if checksums:
        fields.append(pa.field(CHECKSUM_COLUMN, pa.uint32(), nullable=False))
        stated.update(fmt or {})
        stated["checksum"] = CHECKSUM_NAME
    return pa.schema(fields, metadata={SCHEMA_METADATA_KEY: json.dumps(stated, sort_keys=True)})


def cast_like_teacher(values: npt.NDArray[np.float32], dtype: str) -> npt.NDArray[Any]:
    """float32 -> the teacher's cast to ``dtype`` (the wire codec's: float16 with numpy's
    round-to-nearest-even; bfloat16 rounded to nearest even, returned widened to float32
    exactly), which is also what a ``dtype`` recording stores."""
    if dtype == "float32":
        return np.asarray(values, dtype=np.float32)
    if dtype == "float16":
        return np.asarray(values, dtype=np.float32).astype(np.float16)
    return _bf16_bits_to_f32(_f32_to_bf16_bits(np.asarray(values, dtype=np.float32)))


def row_crc(
    key: bytes,
    token_ids: npt.NDArray[np.int32],
    start: int,
    end: int,
    values: dict[str, npt.NDArray[Any] | None],
) -> int:
    """:func:`~topk_protocol.integrity.row_checksum` of a row whose array fields are
    ``values`` (field name -> array in the storage dtype, or None when absent)."""
    return row_checksum(
        key,
        token_ids,
        start,
        end,
        [values[f.name] for f in ARRAY_FIELDS if not f.optional],  # type: ignore[misc]
        [values.get(f.name) for f in ARRAY_FIELDS if f.optional],
    )


def cast_arrays(arrays: SequenceArrays, dtype: str) -> SequenceArrays:
    """Every float field of ``arrays`` cast as the teacher casts to ``dtype``
    (:func:`cast_like_teacher`), held as float32 (exact)."""
    cast: dict[str, Any] = {
        f.name: cast_like_teacher(getattr(arrays, f.name), dtype)
        for f in ARRAY_FIELDS
        if not np.issubdtype(f.dtype, np.integer) and getattr(arrays, f.name) is not None
    }
    return replace(arrays, **cast)


# -- metadata.json -----------------------------------------------------------------------
#: ``metadata.json`` fields the reader relies on, with the JSON types they must have.
_META_TYPES: dict[str, tuple[type, ...]] = {
    "teacher": (dict,),
    "top_k": (int,),
    "dtype": (str,),
    "vocab_size": (int,),
    "tokenizer_fingerprint": (str,),
}


def read_metadata(root: Path) -> tuple[dict[str, Any], pb.TeacherInfo]:
    """``metadata.json`` checked field by field, and the teacher's info it holds; every
    problem is a :class:`RecordingError` naming ``metadata.json`` and the field."""
    path = root / METADATA_FILE
    try:
        meta = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise RecordingError(root, None, f"no {METADATA_FILE}: not a recording") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise RecordingError(path, None, f"unreadable: {e}") from None
    if not isinstance(meta, dict):
        raise RecordingError(path, None, f"not a JSON object but {type(meta).__name__}")
    if meta.get("format") != FORMAT_NAME:
        raise RecordingError(path, None, f"format {meta.get('format')!r}, not {FORMAT_NAME!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise RecordingError(
            path,
            None,
            f"format_version {meta.get('format_version')}; this reader reads {FORMAT_VERSION}",
        )
    for name, types in _META_TYPES.items():
        value = meta.get(name)
        if not isinstance(value, types) or isinstance(value, bool):
            want = " or ".join(t.__name__ for t in types)
            raise RecordingError(path, None, f"{name}: {value!r} is not a JSON {want}")
    meta.setdefault("temperature", DEFAULT_TEACHER_TEMPERATURE)
    problems = []
    if not isinstance(meta.get("options", {}), dict):
        problems.append(f"options: {meta['options']!r} is not a JSON object")
    if meta["top_k"] < 1:
        problems.append(f"top_k: {meta['top_k']} is not >= 1")
    if meta["dtype"] not in DTYPES:
        problems.append(f"dtype: {meta['dtype']!r} is not one of {', '.join(DTYPES)}")
    try:
        meta["temperature"] = check_temperature(meta["temperature"], "temperature")
    except (TypeError, ValueError) as e:
        problems.append(str(e))
    try:
        info = json_format.ParseDict(meta["teacher"], pb.TeacherInfo(), ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise RecordingError(path, None, f"teacher: not a TeacherInfo ({e})") from None
    for name, theirs in (
        ("vocab_size", int(info.vocab_size)),
        ("tokenizer_fingerprint", info.tokenizer_fingerprint),
        ("temperature", teacher_temperature(info)),
    ):
        if meta[name] != theirs and not problems:
            problems.append(f"{name}: {meta[name]!r}, but teacher.{name} says {theirs!r}")
    if problems:
        raise RecordingError(path, None, "; ".join(problems))
    return meta, info


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` through a renamed temporary file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def shards(root: Path) -> list[Path]:
    """The recording's shard files, in the order their rows are numbered."""
    return sorted(p for p in root.glob(f"*{SHARD_SUFFIX}") if p.is_file())


# -- a shard's schema --------------------------------------------------------------------
@dataclass(frozen=True)
class ShardCheck:
    """What a shard's schema says about it: ``damage`` (its columns or schema metadata
    are not a recording's), or how it ``disagrees`` with ``metadata.json``."""

    damage: str | None = None
    disagrees: tuple[str, ...] = ()
    checksums: bool = False


def check_schema(schema: pa.Schema, meta: dict[str, Any]) -> ShardCheck:
    """Compare a shard's schema with what a recording's must be, and with ``meta``."""
    try:
        return _compare_schema(schema, meta)
    except (ValueError, pa.ArrowException) as e:  # e.g. a field name that is not UTF-8
        return ShardCheck(damage=f"its schema does not decode ({type(e).__name__}: {e})")


def _compare_schema(schema: pa.Schema, meta: dict[str, Any]) -> ShardCheck:
    fmt = shard_format(schema.metadata)
    if isinstance(fmt, str):
        return ShardCheck(damage=fmt)
    top_k, dtype = fmt.get("top_k"), fmt.get("dtype")
    if not isinstance(top_k, int) or top_k < 1 or dtype not in DTYPES:
        return ShardCheck(damage=f"its schema states top_k {top_k!r}, dtype {dtype!r}")
    checksums = CHECKSUM_COLUMN in schema.names
    optional = tuple(f.name for f in ARRAY_FIELDS if f.optional and f.name in schema.names)
    want = recording_schema(top_k, str(dtype), checksums=checksums, optional=optional)
    if not schema.remove_metadata().equals(want.remove_metadata()):
        return ShardCheck(
            damage=f"its columns are not those of a K = {top_k} {dtype} recording: "
            + ", ".join(f"{f.name}: {f.type}" for f in schema)
        )
    if checksums and not set(FORMAT_FIELDS) <= set(fmt):
        missing = sorted(set(FORMAT_FIELDS) - set(fmt))
        return ShardCheck(damage=f"its schema metadata lacks {', '.join(missing)}")
    return ShardCheck(disagrees=tuple(format_disagreements(meta, fmt)), checksums=checksums)
