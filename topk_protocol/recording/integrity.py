"""Integrity of recordings: a checksum per row, and what a shard's schema must say.

Every row of a recording (format version 2) carries a CRC-32 of everything that row
serves (:func:`row_checksum`), and every shard's Arrow schema metadata repeats the format
fields of ``metadata.json`` (K, dtype, vocabulary size, tokenizer fingerprint,
temperature: :func:`shard_format`). The reader
(:mod:`topk_protocol.recording`) checks both, so a flipped byte or a ``metadata.json``
that lies is reported (:class:`~topk_protocol.errors.RecordingDamagedError`) instead of
being served as data.

Why CRC-32 (``zlib.crc32``, the standard library) and not a cryptographic hash: the
threat is damage (disk, copy, editing), not an attacker. A CRC-32 detects *every* error
burst of up to 32 bits, so every single-byte flip of a row is caught with certainty
(a hash catches it only with overwhelming probability), and it runs at about 4 GB/s
here, so verifying every row as it is read costs little next to decoding it.

Pure functions over numpy arrays; no I/O.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "CHECKSUM_COLUMN",
    "CHECKSUM_NAME",
    "FORMAT_FIELDS",
    "SCHEMA_METADATA_KEY",
    "format_disagreements",
    "row_checksum",
    "shard_format",
]

#: The column holding each row's checksum (``uint32``).
CHECKSUM_COLUMN = "row_crc32"
#: How the checksum is computed, as the schema metadata names it.
CHECKSUM_NAME = "crc32-row-v1"
#: The Arrow schema metadata key under which a shard repeats the format.
SCHEMA_METADATA_KEY = b"topk_distill"
#: Fields of ``metadata.json`` that a shard's schema metadata repeats (checksummed shards
#: carry all of them; older shards only ``top_k`` and ``dtype``).
FORMAT_FIELDS = ("top_k", "dtype", "vocab_size", "tokenizer_fingerprint", "temperature")


def row_checksum(
    key: bytes,
    token_ids: npt.NDArray[np.int32],
    start: int,
    end: int,
    required: Sequence[npt.NDArray[Any]],
    optional: Sequence[npt.NDArray[Any] | None],
) -> int:
    """CRC-32 of one row: its key, token ids ``[L]``, positions, which ``optional`` arrays
    it has (one bit each, in order), then the bytes of its ``required`` arrays (``ids``
    ``[S, K]``, ``logprobs`` ``[S, K]``) and of the ``optional`` ones present
    (``sampled_logprobs`` ``[S]``), in the storage dtype and byte order the shard holds
    (little-endian). The flags are one byte, bit ``i`` for ``optional[i]``: a row whose
    only optional array is the first, ``sampled_logprobs``, hashes the byte 1 whatever
    optional arrays the format lists after it.

    Rows of a shard are C-contiguous views: their bytes are hashed in place, without a
    copy (other arrays are made contiguous first).
    """
    crc = zlib.crc32(key)
    crc = zlib.crc32(np.ascontiguousarray(token_ids).data, crc)
    present = sum(1 << i for i, a in enumerate(optional) if a is not None)
    crc = zlib.crc32(struct.pack("<iiB", start, end, present), crc)
    for a in [*required, *optional]:
        if a is not None:
            crc = zlib.crc32(np.ascontiguousarray(a).data, crc)
    return crc


def shard_format(schema_metadata: dict[bytes, bytes] | None) -> dict[str, Any] | str:
    """The format fields a shard's schema metadata states, or a sentence saying why it
    states none (missing, not JSON, not an object)."""
    raw = (schema_metadata or {}).get(SCHEMA_METADATA_KEY)
    if raw is None:
        return f"its schema has no {SCHEMA_METADATA_KEY.decode()} metadata"
    try:
        fmt = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        return f"its schema's {SCHEMA_METADATA_KEY.decode()} metadata is not JSON ({e})"
    if not isinstance(fmt, dict):
        return f"its schema's {SCHEMA_METADATA_KEY.decode()} metadata is not a JSON object"
    return fmt


def format_disagreements(meta: dict[str, Any], fmt: dict[str, Any]) -> list[str]:
    """Each format field that ``fmt`` (a shard's :func:`shard_format`) states differently
    from ``meta`` (``metadata.json``), as ``"dtype: metadata.json says 'float32', the
    shard's schema 'float16'"``. Fields the shard does not state are not compared."""
    out = []
    for name in FORMAT_FIELDS:
        if name in fmt and fmt[name] != meta.get(name):
            out.append(
                f"{name}: metadata.json says {meta.get(name)!r}, the shard's schema {fmt[name]!r}"
            )
    return out
