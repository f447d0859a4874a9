"""Answer fingerprints: how a teacher answers fixed canary sequences, and whether two
teachers' answers agree within the engine's stated drift (docs/fingerprint.md).

A teacher scores :func:`canary_sequences` at start-up and announces the top ``K`` ids and
log-probs of their ``P`` positions (``TeacherInfo.answer_fingerprint``). Two fingerprints
agree when they were made on the same canaries, in the same engine dtype, and

- every sorted log-prob is within ``drift`` of the other's (the larger of the two stated
  drifts): sorting is 1-Lipschitz, so two rows whose log-probs are within ``drift`` keep
  their sorted values within ``drift`` even where close entries swap;
- the ids are equal wherever the rank is unambiguous: the entry is more than
  ``2 * drift`` from the ones ranked just above and below it in both answers (closer
  entries may swap by rounding alone; the last column's lower neighbour is unknown, so its
  ids are not compared).

Never an exact hash: two CPUs with other SIMD kernels, or two batches on one GPU, round
differently, and a hash would flip at a rounding boundary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from google.protobuf import json_format

from topk_protocol._generated import teacher_pb2 as pb

__all__ = [
    "CANARY_LENGTH",
    "CANARY_SEQUENCES",
    "CANARY_TOP_K",
    "CANARY_VERSION",
    "STATED_DRIFT",
    "AnswerFingerprint",
    "FingerprintFileError",
    "answer_problems",
    "canary_name",
    "canary_sequences",
    "differences",
    "load_fingerprint",
    "stated_drift",
]

CANARY_VERSION = "v1"
#: Canary sequences, tokens per sequence and K: 4 x 64 = 256 positions of 8 columns
#: (4 KiB of ids and log-probs).
CANARY_SEQUENCES = 4
CANARY_LENGTH = 64
CANARY_TOP_K = 8

#: Largest log-prob difference between two replicas of one engine that still agree, by
#: the dtype the engine computes in: float32 differs by the order of its sums (another
#: CPU's SIMD kernels, another GPU, another batch; the tiny test model stays within 1e-4
#: between vLLM and transformers), half precisions by their rounding of every activation.
STATED_DRIFT = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
#: An engine dtype not in the table.
DEFAULT_DRIFT = 5e-2

_MASK64 = (1 << 64) - 1


def stated_drift(engine_dtype: str) -> float:
    """The drift :data:`STATED_DRIFT` states for ``engine_dtype``."""
    return STATED_DRIFT.get(engine_dtype, DEFAULT_DRIFT)


def canary_name(num_sequences: int = CANARY_SEQUENCES, length: int = CANARY_LENGTH) -> str:
    """``"v1:4x64"``: the canary set's version and shape."""
    return f"{CANARY_VERSION}:{num_sequences}x{length}"


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def canary_sequences(
    vocab_size: int, num_sequences: int = CANARY_SEQUENCES, length: int = CANARY_LENGTH
) -> list[npt.NDArray[np.int32]]:
    """The canaries: ``num_sequences`` int32 arrays ``[length]`` of ids in
    ``[0, vocab_size)``, a fixed hash of (sequence, position): the same on every machine
    and library version."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size: must be >= 1, got {vocab_size}")
    return [
        np.array([_splitmix64((s << 32) | t) % vocab_size for t in range(length)], dtype=np.int32)
        for s in range(num_sequences)
    ]


class FingerprintFileError(ValueError):
    """A reference fingerprint file that cannot be read; the message names the file."""


@dataclass(frozen=True, eq=False)
class AnswerFingerprint:
    """A teacher's answers to the canaries: ``ids`` and ``logprobs`` ``[P, K]`` (rows
    descending), the canary set (:func:`canary_name`), the engine dtype they were computed
    in, the drift it states, and the model's name (for messages)."""

    canary: str
    ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    drift: float
    engine_dtype: str
    model_name: str = ""

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[1])

    def to_message(self) -> pb.AnswerFingerprint:
        return pb.AnswerFingerprint(
            canary=self.canary,
            top_k=self.top_k,
            ids=np.ascontiguousarray(self.ids, dtype="<i4").tobytes(),
            logprobs=np.ascontiguousarray(self.logprobs, dtype="<f4").tobytes(),
            drift=self.drift,
            engine_dtype=self.engine_dtype,
            model_name=self.model_name,
        )

    @classmethod
    def from_message(cls, msg: pb.AnswerFingerprint) -> AnswerFingerprint:
        """The fingerprint a message carries; ``ValueError`` naming the field when its
        arrays do not have ``[P, top_k]`` entries."""
        k = int(msg.top_k)
        if k < 1:
            raise ValueError(f"answer_fingerprint.top_k: must be >= 1, got {k}")
        arrays = {}
        for name, dtype in (("ids", "<i4"), ("logprobs", "<f4")):
            blob = getattr(msg, name)
            if len(blob) % (4 * k):
                raise ValueError(
                    f"answer_fingerprint.{name}: {len(blob)} bytes is not rows of {k} 4-byte values"
                )
            arrays[name] = np.frombuffer(blob, dtype=dtype).reshape(-1, k)
        if not len(arrays["ids"]):
            raise ValueError("answer_fingerprint: no canary positions")
        if arrays["ids"].shape != arrays["logprobs"].shape:
            raise ValueError(
                f"answer_fingerprint: ids {arrays['ids'].shape} and logprobs "
                f"{arrays['logprobs'].shape} differ in shape"
            )
        return cls(
            canary=msg.canary,
            ids=arrays["ids"].astype(np.int32),
            logprobs=arrays["logprobs"].astype(np.float32),
            drift=float(msg.drift),
            engine_dtype=msg.engine_dtype,
            model_name=msg.model_name,
        )

    @classmethod
    def of_info(cls, info: pb.TeacherInfo) -> AnswerFingerprint | None:
        """The fingerprint a ``TeacherInfo`` announces (None: it announces none)."""
        if not info.HasField("answer_fingerprint"):
            return None
        return cls.from_message(info.answer_fingerprint)

    def to_json(self) -> str:
        """The message as JSON (what ``--expect-fingerprint`` reads back)."""
        return json_format.MessageToJson(self.to_message(), preserving_proto_field_name=True)


def differences(mine: AnswerFingerprint, reference: AnswerFingerprint) -> list[str]:
    """What differs between two fingerprints, one phrase each (empty: they agree); the
    rules are the module's."""
    if mine.canary != reference.canary or mine.ids.shape != reference.ids.shape:
        return [
            f"canaries: {mine.canary} with {mine.ids.shape} answers, the reference "
            f"{reference.canary} with {reference.ids.shape} (not comparable)"
        ]
    problems = []
    if mine.engine_dtype != reference.engine_dtype:
        problems.append(
            f"engine dtype: {mine.engine_dtype or 'none'}, the reference "
            f"{reference.engine_dtype or 'none'}"
        )
    drift = max(mine.drift, reference.drift)
    a, b = mine.logprobs.astype(np.float64), reference.logprobs.astype(np.float64)
    # -inf == -inf (a zero-probability entry) counts as equal.
    delta = np.where(a == b, 0.0, np.abs(a - b))
    delta = np.nan_to_num(delta, nan=np.inf)
    over = delta > drift
    if over.any():
        rows = np.flatnonzero(over.any(axis=1))
        problems.append(
            f"log-probs: differ by up to {float(delta.max()):.4g} (drift {drift:g}) at "
            f"{len(rows)} of {len(a)} canary positions, first at position {int(rows[0])}"
        )
    clear = _unambiguous(a, drift) & _unambiguous(b, drift)
    wrong = clear & (mine.ids != reference.ids)
    if wrong.any():
        rows = np.flatnonzero(wrong.any(axis=1))
        problems.append(
            f"top ids: differ at {int(wrong.sum())} of {int(clear.sum())} unambiguous ranks "
            f"({len(rows)} canary positions, first at position {int(rows[0])})"
        )
    return problems


def _unambiguous(logprobs: npt.NDArray[np.float64], drift: float) -> npt.NDArray[np.bool_]:
    """``[P, K]`` bool: more than ``2 * drift`` from the entries just above and below
    (the last column: never, its lower neighbour is not in the answer)."""
    gaps = -np.diff(logprobs, axis=1) > 2 * drift  # [P, K - 1]; NaN compares False
    clear = np.zeros(logprobs.shape, dtype=bool)
    clear[:, :-1] = gaps
    clear[:, 1:-1] &= gaps[:, :-1]
    return clear


def load_fingerprint(path: str | Path) -> AnswerFingerprint:
    """The reference fingerprint in ``path``: a fingerprint's JSON
    (:meth:`AnswerFingerprint.to_json`), a teacher's ``/v1/info`` JSON, or a recording
    (its directory or its ``metadata.json``), whose teacher's fingerprint it holds. Raises
    :class:`FingerprintFileError` naming the file and what is wrong."""
    path = Path(path)
    if path.is_dir():
        path = path / "metadata.json"
    try:
        data: Any = json.loads(path.read_text())
    except OSError as e:
        raise FingerprintFileError(f"fingerprint file {path}: cannot read it ({e})") from None
    except ValueError as e:
        raise FingerprintFileError(f"fingerprint file {path}: not JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("teacher"), dict):
        data = data["teacher"]  # a recording's metadata.json
    if isinstance(data, dict) and "answer_fingerprint" in data:
        data = data["answer_fingerprint"]  # a TeacherInfo (/v1/info)
    if not isinstance(data, dict) or "ids" not in data or "logprobs" not in data:
        raise FingerprintFileError(
            f"fingerprint file {path}: holds no answer fingerprint (expected a "
            "fingerprint's JSON with ids and logprobs, a teacher's /v1/info or a recording "
            "whose teacher announced one)"
        )
    try:
        msg = json_format.ParseDict(data, pb.AnswerFingerprint(), ignore_unknown_fields=True)
        return AnswerFingerprint.from_message(msg)
    except (json_format.ParseError, ValueError) as e:
        raise FingerprintFileError(f"fingerprint file {path}: {e}") from None


def answer_problems(
    mine: pb.TeacherInfo, reference: pb.TeacherInfo, whose: str = "the recorded one"
) -> list[str]:
    """What differs between the answers of two ``TeacherInfo`` messages' teachers, as
    ``answer_fingerprint: ...`` phrases (empty: they agree, or one announces none);
    ``whose`` names the reference in the message."""
    a, b = AnswerFingerprint.of_info(mine), AnswerFingerprint.of_info(reference)
    if a is None or b is None:
        return []
    return [
        f"answer_fingerprint: this teacher (model {a.model_name!r}, dtype "
        f"{a.engine_dtype or 'none'}) disagrees with {whose} (model "
        f"{b.model_name!r}, dtype {b.engine_dtype or 'none'}): " + "; ".join(found)
        for found in [differences(a, b)]
        if found
    ]
