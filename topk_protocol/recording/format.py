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
``candidate_ids``             ``list<list<int32>>``, null without        ``[S, C]``, -1 pads
``candidate_logprobs``        ``list<list<F>>``, null without            ``[S, C]``, NaN at -1
``sample_counts``             ``list<fixed_size_list<uint8, K>>``, null  ``[S, K]`` draws
``proposal_log_normalizer``   ``list<F>``, null unless tempered          ``[S]`` ``log Z``
``row_crc32``                 ``uint32``                                 the row's checksum
============================  =========================================  ==================

A packed recording (``metadata.json`` ``"encoding": "packed"``) has ``binary`` columns
``packed_ids`` and ``packed_logprobs`` in place of ``ids`` and ``logprobs``: each row's
packed payload bytes (:mod:`topk_protocol.recording.packed`).

``S = position_end - position_start``; row ``j`` is position ``position_start + j``. ``F``
is ``float16`` for a float16 recording and ``float32`` for float32 and bfloat16 ones
(bfloat16 values widened to float32, which is exact). ``C`` (candidate ids per position)
is a row's own: every position of a row has ``C`` entries, rows differ. The columns from
``ids`` on are the
array fields of :class:`~topk_protocol.arrays.SequenceArrays`, in order
(:func:`recording_schema` derives them from it); an optional field's column may be
absent from a shard written before the field existed (its rows then have none).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from google.protobuf import descriptor, json_format

from topk_protocol import (
    DEFAULT_TEACHER_TEMPERATURE,
    check_temperature,
    pb,
    teacher_temperature,
)
from topk_protocol.arrays import WIRE_FIELDS, ArrayField, SequenceArrays
from topk_protocol.checks import MAX_LOGPROB_BITS, MIN_LOGPROB_BITS
from topk_protocol.codec import ENCODING_NAMES
from topk_protocol.errors import RecordingError
from topk_protocol.floats import cast_like_teacher
from topk_protocol.packing import Packing
from topk_protocol.recording.integrity import (
    CHECKSUM_COLUMN,
    CHECKSUM_NAME,
    FORMAT_FIELDS,
    SCHEMA_METADATA_KEY,
    format_disagreements,
    row_checksum,
    shard_format,
)
from topk_protocol.recording.packed import PACKED_COLUMNS
from topk_protocol.storage import Location, StorageError

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_FLUSH_BYTES",
    "DEFAULT_FLUSH_INTERVAL_S",
    "DEFAULT_OBJECT_FLUSH_BYTES",
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
    "next_shard_number",
    "read_metadata",
    "recording_packing",
    "recording_schema",
    "row_crc",
    "sequence_key",
    "shard_name",
    "shards",
    "storage_dtype",
    "teacher_info_json",
    "write_json_atomic",
]

FORMAT_NAME = "topk-distill-payloads"
FORMAT_VERSION = 2  # version 1, a single-file ``.tkrec`` container, is not read
METADATA_FILE = "metadata.json"
SHARD_SUFFIX = ".arrow"
DEFAULT_FLUSH_INTERVAL_S = 2.0
#: A writer on a local disk flushes early once its buffered rows hold this many bytes, so
#: what it holds does not grow with the teacher's speed (2 s of a GPU teacher's rows at
#: K = 64 are over 100 MiB); a record batch of 4 MiB reads as fast as a bigger one.
DEFAULT_FLUSH_BYTES = 4 << 20
#: The same on an object store, where each flush is one shard object: large enough that a
#: fast teacher makes about one object a second, not dozens.
DEFAULT_OBJECT_FLUSH_BYTES = 64 << 20
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


def teacher_info_json(info: pb.TeacherInfo) -> dict[str, Any]:
    """``info`` as ``metadata.json`` stores it: the protobuf JSON mapping, with 64-bit
    integers (``max_tokens_per_request``) as JSON numbers rather than the mapping's
    strings (``json_format.ParseDict`` reads either back)."""
    out = json_format.MessageToDict(info, preserving_proto_field_name=True)
    for f in info.DESCRIPTOR.fields:
        if f.name in out and f.cpp_type in _INT64_CPP_TYPES and isinstance(out[f.name], str):
            out[f.name] = int(out[f.name])
    return out


_INT64_CPP_TYPES = frozenset(
    {
        descriptor.FieldDescriptor.CPPTYPE_INT64,
        descriptor.FieldDescriptor.CPPTYPE_UINT64,
    }
)


def can_serve_dtype(recorded: str, wanted: str) -> bool:
    """Whether values recorded in ``recorded`` give exactly what the teacher sends in
    ``wanted``: the teacher computes float32 and casts once, so a float32 recording serves
    every dtype; a float16 or bfloat16 one only itself."""
    return recorded == "float32" or recorded == wanted


def recording_packing(stated: dict[str, Any]) -> Packing | None:
    """The packing a recording's ``metadata.json`` (or a shard's schema metadata) states:
    None unless its ``encoding`` is ``"packed"`` (a recording older than the field
    holds the default encoding)."""
    if stated.get("encoding", "default") != "packed":
        return None
    return Packing.of(int(stated["vocab_size"]), int(stated["logprob_bits"]))


def packing_metadata(packing: Packing | None) -> dict[str, Any]:
    """The ``metadata.json`` / schema metadata fields stating ``packing`` (none for the
    default encoding, so a default recording's files are what they were)."""
    if packing is None:
        return {}
    return {"encoding": "packed", "logprob_bits": packing.logprob_bits}


def storage_dtype(f: ArrayField, dtype: str) -> type[np.generic]:
    """The numpy dtype a ``dtype`` recording stores field ``f`` in: an integer field in its
    own dtype (int32 ids, uint8 sample counts), and float16 (a float16 recording) or
    float32 for log-probs."""
    if np.issubdtype(f.dtype, np.integer):
        return f.dtype
    return np.float16 if dtype == "float16" else np.float32


def _arrow_type(f: ArrayField, dtype: str, top_k: int) -> pa.DataType:
    value = pa.from_numpy_dtype(storage_dtype(f, dtype))
    if f.candidates:  # C is each row's own: a list per position
        return pa.list_(pa.list_(value))
    return pa.list_(pa.list_(value, top_k) if f.columns else value)


def recording_schema(
    top_k: int,
    dtype: str,
    fmt: dict[str, Any] | None = None,
    *,
    checksums: bool = True,
    optional: tuple[str, ...] | None = None,
    packing: Packing | None = None,
) -> pa.Schema:
    """The Arrow schema of a recording with ``top_k`` and log-prob ``dtype`` (name).

    ``fmt``: the other format fields the schema metadata repeats (``vocab_size``,
    ``tokenizer_fingerprint``, ``temperature``); ``checksums=False``: the columns of a
    shard written before the ``row_crc32`` column existed; ``optional``: the optional
    array fields that have a column (default: all of them); ``packing``: a packed
    recording's (binary columns in place of ``ids`` and ``logprobs``).
    """
    fields = [
        pa.field("key", pa.binary(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("position_start", pa.int32(), nullable=False),
        pa.field("position_end", pa.int32(), nullable=False),
    ]
    for f in WIRE_FIELDS:
        if f.optional and optional is not None and f.name not in optional:
            continue
        if packing is not None and f.name in PACKED_COLUMNS:
            fields.append(pa.field(PACKED_COLUMNS[f.name], pa.binary(), nullable=False))
            continue
        fields.append(pa.field(f.name, _arrow_type(f, dtype, top_k), nullable=f.optional))
    stated: dict[str, Any] = {"top_k": top_k, "dtype": dtype, **packing_metadata(packing)}
    if checksums:
        fields.append(pa.field(CHECKSUM_COLUMN, pa.uint32(), nullable=False))
        stated.update(fmt or {})
        stated["checksum"] = CHECKSUM_NAME
    return pa.schema(fields, metadata={SCHEMA_METADATA_KEY: json.dumps(stated, sort_keys=True)})


def row_crc(
    key: bytes,
    token_ids: npt.NDArray[np.int32],
    start: int,
    end: int,
    values: dict[str, npt.NDArray[Any] | None],
) -> int:
    """:func:`~topk_protocol.recording.integrity.row_checksum` of a row whose array fields are
    ``values`` (field name -> array in the storage dtype, or None when absent)."""
    return row_checksum(
        key,
        token_ids,
        start,
        end,
        [values[f.name] for f in WIRE_FIELDS if not f.optional],  # type: ignore[misc]
        [values.get(f.name) for f in WIRE_FIELDS if f.optional],
    )


def cast_arrays(arrays: SequenceArrays, dtype: str) -> SequenceArrays:
    """Every float field of ``arrays`` cast as the teacher casts to ``dtype``
    (:func:`cast_like_teacher`), held as float32 (exact)."""
    cast: dict[str, Any] = {
        f.name: cast_like_teacher(getattr(arrays, f.name), dtype)
        for f in WIRE_FIELDS
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


def read_metadata(root: Location) -> tuple[dict[str, Any], pb.TeacherInfo]:
    """``metadata.json`` checked field by field, and the teacher's info it holds; every
    problem is a :class:`RecordingError` naming ``metadata.json`` and the field (and one
    the store raised, e.g. an unreachable bucket, names the location)."""
    path = root.child(METADATA_FILE)
    try:
        if not path.is_file():
            raise RecordingError(root, None, f"no {METADATA_FILE}: not a recording")
        meta = json.loads(path.read_bytes())
    except StorageError as e:
        raise RecordingError(root, None, f"cannot read it: {e}") from None
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
    problems.extend(_packing_problems(meta))
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


def _packing_problems(stated: dict[str, Any]) -> list[str]:
    """What is wrong with the encoding fields of ``metadata.json`` / a shard's schema."""
    encoding = stated.get("encoding", "default")
    if encoding not in ENCODING_NAMES:
        return [f"encoding: {encoding!r} is not one of {', '.join(ENCODING_NAMES)}"]
    bits = stated.get("logprob_bits")
    if encoding == "packed" and (
        not isinstance(bits, int) or not MIN_LOGPROB_BITS <= bits <= MAX_LOGPROB_BITS
    ):
        return [f"logprob_bits: {bits!r} is not in [{MIN_LOGPROB_BITS}, {MAX_LOGPROB_BITS}]"]
    return []


def write_json_atomic(path: Location, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path``, whole or not at all
    (:meth:`~topk_protocol.storage.Location.write_bytes_atomic`)."""
    path.write_bytes_atomic((json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


_SHARD_NUMBER = re.compile(r"shard-(\d+)-")


def shard_name(number: int) -> str:
    """A new shard's file name: its number (the order its rows are numbered in) and a
    random id (two writers never pick one name)."""
    return f"shard-{number:05d}-{uuid.uuid4().hex[:8]}{SHARD_SUFFIX}"


def _shard_order(name: str) -> tuple[int, str]:
    match = _SHARD_NUMBER.match(name)
    return (int(match.group(1)) if match else -1, name)


def next_shard_number(found: list[tuple[Location, int]]) -> int:
    """The number of a new shard after the ``found`` ones (:func:`shards`): one more than
    the largest (numbers a failed upload used are not reused, so the order stays whole)."""
    return max((_shard_order(s.name)[0] for s, _ in found), default=-1) + 1


def shards(root: Location) -> list[tuple[Location, int]]:
    """The recording's shard files and their sizes in bytes, in the order their rows are
    numbered (by shard number, so ``shard-100000-*`` follows ``shard-99999-*``)."""
    return sorted(root.files(SHARD_SUFFIX), key=lambda item: _shard_order(item[0].name))


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
    optional = tuple(f.name for f in WIRE_FIELDS if f.optional and f.name in schema.names)
    problems = _packing_problems(fmt)
    if problems:
        return ShardCheck(damage="its schema states " + "; ".join(problems))
    packing = recording_packing({**meta, **fmt})
    want = recording_schema(
        top_k, str(dtype), checksums=checksums, optional=optional, packing=packing
    )
    if not schema.remove_metadata().equals(want.remove_metadata()):
        return ShardCheck(
            damage=f"its columns are not those of a K = {top_k} {dtype} recording: "
            + ", ".join(f"{f.name}: {f.type}" for f in schema)
        )
    if checksums and not set(FORMAT_FIELDS) <= set(fmt):
        missing = sorted(set(FORMAT_FIELDS) - set(fmt))
        return ShardCheck(damage=f"its schema metadata lacks {', '.join(missing)}")
    disagrees = format_disagreements(meta, fmt)
    for name, default in (("encoding", "default"), ("logprob_bits", None)):
        if fmt.get(name, default) != meta.get(name, default):
            disagrees.append(
                f"{name}: metadata.json says {meta.get(name, default)!r}, the shard's schema "
                f"{fmt.get(name, default)!r}"
            )
    return ShardCheck(disagrees=tuple(disagrees), checksums=checksums)
