"""Collect the answer to one request, check it against the request, decode it.

:class:`ResponseAssembler` takes the answer to one request (one ``Score`` message or the
row chunks of ``ScoreStream``), checks it against the request, and decodes it into a padded
:class:`~student_client.data.payload.TeacherPayload` with one vectorized copy per chunk (no
per-element loop). It knows the request and the wire; where the batch's rows sit when the
batch came padded is the caller's business (:mod:`student_client.data.alignment`).

Padding of ragged batches: rows past a sequence's end have ``ids`` 0, ``logprobs`` 0,
``sampled_logprobs`` 0 and ``mask`` False (see :class:`TeacherPayload`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from student_client.data.padding import PayloadBuffers
from student_client.data.payload import TeacherPayload
from topk_protocol import (
    RequestOptions,
    SequenceArrays,
    decode_sequence,
    decode_sequence_into,
    dtype_from_name,
    dtype_name,
    encode_sequence,
    itemsize,
    pb,
    request_spans,
)
from topk_protocol.errors import TeacherError
from topk_protocol.packing import Packing, packed_payload_bytes
from topk_protocol.status import error_from_code

__all__ = ["ResponseAssembler"]

_LE_I32 = np.dtype("<i4")


def _protocol(message: str) -> TeacherError:
    return TeacherError(f"teacher answer does not match the request: {message}")


class ResponseAssembler:
    """Collects the answer to one request and decodes it.

    Feed every ``ScoreResponse`` of the request to :meth:`add` (one unary answer, or the
    stream's row chunks in arrival order). Once :attr:`complete`, :meth:`payload` builds
    the tensors, :meth:`sequences` each sequence's decoded rows (what a recording
    stores, with :attr:`options`) and :meth:`merged_response` the equivalent single
    message (chunks joined). An ``error`` answer sets :attr:`error` instead.

    ``options``: the :class:`RequestOptions` the request was built with, handed on by
    the client that built it (None: read back from ``request``).
    """

    def __init__(self, request: pb.ScoreRequest, options: RequestOptions | None = None) -> None:
        self.request = request
        self.spans = request_spans(request)
        if options is None:  # a request built elsewhere: read its options back
            options = RequestOptions.from_proto(request)
        self.top_k = options.top_k
        self.dtype = options.wire_dtype
        self.include_sampled = options.include_sampled
        self.options = options
        self.sampled = options.sampled
        self.proposal_normalizer = options.proposal_normalizer
        self.teacher_seconds = 0.0
        self._size = itemsize(self.dtype)
        #: Each sequence's candidate ids ``[S_i, C_i]`` as requested (None: none).
        self.candidates = [
            np.frombuffer(seq.candidate_ids, dtype=_LE_I32).reshape(
                end - start, int(seq.num_candidates)
            )
            if seq.num_candidates
            else None
            for seq, (start, end) in zip(request.sequences, self.spans, strict=True)
        ]
        self.reset()

    def reset(self) -> None:
        """Forget partial chunks (the request is being sent again)."""
        self._chunks: list[list[pb.SequencePayload]] = [[] for _ in self.spans]
        self._rows = [0] * len(self.spans)
        #: The padded buffers each chunk is decoded into as it arrives (None until the
        #: first rows, and after :meth:`payload` handed them out).
        self._buffers: PayloadBuffers | None = None
        self.complete = False
        self.error: TeacherError | None = None

    def _new_buffers(self) -> PayloadBuffers:
        """Empty padded buffers for the whole answer: ``[B, S, ...]``, ``S`` the longest
        requested range (every range is answered in full, or the answer is refused)."""
        present = {
            "sampled_logprobs": self.include_sampled,
            "sample_counts": self.sampled,
            "proposal_log_normalizer": self.proposal_normalizer,
            "candidate_ids": any(c is not None for c in self.candidates),
            "candidate_logprobs": any(c is not None for c in self.candidates),
        }
        return PayloadBuffers(
            [name for name, held in present.items() if held],
            len(self.spans),
            max((end - start for start, end in self.spans), default=0),
            self.top_k,
            max((0 if c is None else c.shape[1] for c in self.candidates), default=0),
        )

    def _decode_into(self, out: PayloadBuffers, i: int, row: int, c: pb.SequencePayload) -> None:
        """Decode chunk ``c`` (``n`` rows of sequence ``i``) into ``out`` at rows
        ``[row, row + n)``, reading each bytes field once (each read copies it).
        :class:`TeacherError` naming the field when a byte length does not fit."""
        n, cand = int(c.num_positions), self.candidates[i]
        try:
            decode_sequence_into(
                out.views((i, slice(row, row + n)), 0 if cand is None else cand.shape[1]), c
            )
        except ValueError as e:
            raise _protocol(f"sequences[{i}]: {e} for [{n}, {self.top_k}]") from None

    def add(self, msg: pb.ScoreResponse) -> None:
        """Take one response message of this request. Raises :class:`TeacherError` when it
        contradicts the request (wrong K, dtype, positions, byte lengths)."""
        if msg.HasField("error"):
            self.error = error_from_code(msg.error.code, msg.error.message, msg.error.reason)
            self.complete = True
            return
        for chunk in msg.sequences:
            self._add_chunk(chunk)
        if msg.final:
            self.teacher_seconds = float(msg.teacher_seconds)
            for i, ((start, end), rows) in enumerate(zip(self.spans, self._rows, strict=True)):
                if rows != end - start:
                    raise _protocol(
                        f"sequences[{i}]: got {rows} rows, expected {end - start} "
                        f"(positions [{start}, {end}))"
                    )
            self.complete = True

    def _add_chunk(self, c: pb.SequencePayload) -> None:
        i = int(c.sequence_index)
        if i >= len(self.spans):
            raise _protocol(f"sequence_index {i} is outside the request's {len(self.spans)}")
        n, k = int(c.num_positions), self.top_k
        where = f"sequences[{i}]"
        if n and int(c.top_k) != k:
            raise _protocol(f"{where}: top_k {c.top_k}, requested {k}")
        if n and dtype_from_name(int(c.dtype)) != self.dtype:
            raise _protocol(f"{where}: dtype {c.dtype}, requested {self.dtype}")
        expected_start = self.spans[i][0] + self._rows[i]
        if int(c.position_start) != expected_start and n:
            raise _protocol(
                f"{where}: chunk starts at position {c.position_start}, expected {expected_start}"
            )
        if self._rows[i] + n > self.spans[i][1] - self.spans[i][0]:
            raise _protocol(f"{where}: more rows than the positions requested")
        if n:
            self._check_encoding(c, where)
        want_sampled = n * self._size if self.include_sampled else 0
        if len(c.sampled_logprobs) != want_sampled:
            raise _protocol(
                f"{where}: sampled_logprobs has {len(c.sampled_logprobs)} bytes, "
                f"expected {want_sampled}"
            )
        cand = self.candidates[i]
        want_c = 0 if cand is None else cand.shape[1]
        if (n and int(c.num_candidates) != want_c) or len(c.candidate_logprobs) != (
            n * want_c * self._size
        ):
            raise _protocol(
                f"{where}: {c.num_candidates} candidates in {len(c.candidate_logprobs)} "
                f"bytes, requested [{n}, {want_c}]"
            )
        for name, want in (
            ("sample_counts", n * k if self.sampled else 0),
            ("proposal_log_normalizer", n * self._size if self.proposal_normalizer else 0),
        ):
            if len(getattr(c, name)) != want:
                raise _protocol(
                    f"{where}: {name} has {len(getattr(c, name))} bytes, expected {want}"
                )
        if n:  # decoded as it arrives: the byte lengths are checked on the one read
            if self._buffers is None:
                self._buffers = self._new_buffers()
            self._decode_into(self._buffers, i, self._rows[i], c)
        self._chunks[i].append(c)
        self._rows[i] += n

    def _check_encoding(self, c: pb.SequencePayload, where: str) -> None:
        """The chunk has the encoding asked (a packed one: its bit widths and byte
        lengths; a default one's byte lengths are checked as it is decoded)."""
        n, k = int(c.num_positions), self.top_k
        if int(c.encoding) != self.options.wire_encoding:
            raise _protocol(f"{where}: encoding {c.encoding}, requested {self.options.encoding}")
        if self.options.logprob_bits is None:
            return
        if int(c.logprob_bits) != self.options.logprob_bits:
            raise _protocol(
                f"{where}: logprob_bits {c.logprob_bits}, requested {self.options.logprob_bits}"
            )
        if not 1 <= int(c.id_bits) <= 32:
            raise _protocol(f"{where}: id_bits {c.id_bits} is outside [1, 32]")
        want = packed_payload_bytes(
            n, k, 1 << int(c.id_bits), int(c.logprob_bits), self._size, include_sampled=False
        )
        got = len(c.packed_ids) + len(c.packed_logprobs)
        if got != want or c.ids or c.logprobs:
            raise _protocol(
                f"{where}: packed byte lengths {len(c.packed_ids)} + "
                f"{len(c.packed_logprobs)} do not fit [{n}, {k}] at id_bits {c.id_bits}, "
                f"logprob_bits {c.logprob_bits}"
            )

    def sequences(self) -> list[SequenceArrays | None]:
        """Each sequence's rows decoded and joined (candidate ids included; None: an
        empty range), what :meth:`RecordingWriter.write_sequences
        <topk_protocol.recording.writer.RecordingWriter.write_sequences>` records."""
        if not self.complete or self.error is not None:
            raise TeacherError("sequences: the request is not answered (or failed)")
        return [self._joined(i) if rows else None for i, rows in enumerate(self._rows)]

    def _joined(self, i: int) -> SequenceArrays:
        """Sequence ``i``'s chunks decoded and joined (at least one row)."""
        cand, parts, row = self.candidates[i], [], 0
        for c in self._chunks[i]:
            n = int(c.num_positions)
            if n:
                parts.append(decode_sequence(c, None if cand is None else cand[row : row + n]))
                row += n
        return SequenceArrays.concat(parts)

    def merged_response(self) -> pb.ScoreResponse:
        """The complete answer as one message: one ``SequencePayload`` per sequence."""
        if not self.complete or self.error is not None:
            raise TeacherError("merged_response: the request is not answered (or failed)")
        out = pb.ScoreResponse(
            request_id=self.request.request_id,
            final=True,
            teacher_seconds=self.teacher_seconds,
        )
        for i, chunks in enumerate(self._chunks):
            if self.options.logprob_bits is not None:
                out.sequences.append(self._merged_packed(i, chunks))
                continue
            out.sequences.append(
                pb.SequencePayload(
                    sequence_index=i,
                    position_start=self.spans[i][0],
                    num_positions=self._rows[i],
                    top_k=self.top_k,
                    dtype=self.dtype,  # type: ignore[arg-type]
                    ids=b"".join(c.ids for c in chunks),
                    logprobs=b"".join(c.logprobs for c in chunks),
                    sampled_logprobs=b"".join(c.sampled_logprobs for c in chunks),
                    candidate_logprobs=b"".join(c.candidate_logprobs for c in chunks),
                    num_candidates=self.request.sequences[i].num_candidates,
                    sample_counts=b"".join(c.sample_counts for c in chunks),
                    proposal_log_normalizer=b"".join(c.proposal_log_normalizer for c in chunks),
                )
            )
        return out

    def _merged_packed(self, i: int, chunks: list[pb.SequencePayload]) -> pb.SequencePayload:
        """A packed sequence's chunks as one payload: decoded, joined and packed again,
        which gives the bytes of a one-message answer (packing decoded rows is
        idempotent, :mod:`topk_protocol.packing`). Candidate log-probs travel unpacked:
        their bytes are joined as they came, as in a default answer."""
        joined = (
            self._joined(i) if self._rows[i] else SequenceArrays.empty(self.top_k, self.spans[i][0])
        )
        joined = replace(joined, candidate_ids=None, candidate_logprobs=None)
        first = chunks[0] if chunks else pb.SequencePayload(id_bits=1)
        packing = Packing(int(first.id_bits), int(self.options.logprob_bits or 0))
        msg = encode_sequence(joined, dtype=self.dtype, sequence_index=i, packing=packing)
        msg.candidate_logprobs = b"".join(c.candidate_logprobs for c in chunks)
        msg.num_candidates = self.request.sequences[i].num_candidates
        return msg

    def payload(self, device: torch.device | str = "cpu") -> TeacherPayload:
        """Decode into padded ``[B, S, K]`` tensors on ``device`` (raises :attr:`error`)."""
        if self.error is not None:
            raise self.error
        if not self.complete:
            raise TeacherError("payload: the request is not answered yet")
        out, self._buffers = self._buffers, None  # handed out: a second call decodes anew
        if out is None:
            out = self._new_buffers()
            for i, chunks in enumerate(self._chunks):
                row = 0
                for c in chunks:
                    if int(c.num_positions):
                        self._decode_into(out, i, row, c)
                        row += int(c.num_positions)
        for i, rows in enumerate(self._rows):
            out.put((i, slice(0, rows)), {"mask": True, "candidate_ids": self.candidates[i]})
        payload = out.payload(
            position_start=torch.tensor([sp[0] for sp in self.spans], dtype=torch.int64),
            lengths=torch.tensor(self._rows, dtype=torch.int64),
            top_k=self.top_k,
            dtype=dtype_name(self.dtype),
            request_id=self.request.request_id,
            teacher_seconds=self.teacher_seconds,
            proposal_temperature=self.options.proposal_temperature,
        )
        return payload if str(device) == "cpu" else payload.to(device)
