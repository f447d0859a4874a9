"""``record_to=``: a live client's recording of every answered request.

:class:`AnswerRecorder` opens the recording on the first answer (with the teacher's
``GetInfo`` and the client's targets in its metadata), refuses a request whose answer it
could not record before the request is sent, and records each answer from the decoded
rows and the options the client built the request with (nothing re-derived or
re-encoded: :meth:`~student_client.data.assembler.ResponseAssembler.sequences`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from student_client.data.assembler import ResponseAssembler
from topk_protocol import RequestOptions, pb
from topk_protocol.recording import RecordingWriter
from topk_protocol.storage import location

__all__ = ["AnswerRecorder"]


class AnswerRecorder:
    """Records a client's answers to ``path`` (None: records nothing).

    Args:
        path: the recording directory or URI (``s3://bucket/prefix``).
        compression: ``"auto"`` (zstd), ``"zstd"``, ``"lz4"`` or ``"none"``.
        metadata: extra JSON metadata for the recording's ``metadata.json``.

    Thread-safe (the blocking client's callers and its loop may record at once).
    """

    def __init__(
        self,
        path: str | Path | None,
        compression: str = "auto",
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.path = None if path is None else location(path)
        self._compression = compression
        self._metadata = dict(metadata or {})
        self._writer: RecordingWriter | None = None
        self._lock = threading.Lock()

    def check(self, asked: RequestOptions) -> None:
        """``RecordingError`` naming the option when the answer to a request asked with
        ``asked`` could not be recorded here (nothing to check before the first one)."""
        if self._writer is not None:
            self._writer.check_request(asked)

    def write(self, asm: ResponseAssembler, info: pb.TeacherInfo, targets: Sequence[str]) -> None:
        """Record an answered request (an answer with an error is not recorded);
        ``info``: the answering teacher's ``GetInfo``, ``targets``: the client's."""
        if self.path is None or asm.error is not None:
            return
        with self._lock:
            if self._writer is None:
                self._writer = RecordingWriter(
                    self.path,
                    info,
                    compression=self._compression,
                    metadata={"targets": list(targets), **self._metadata},
                )
        self._writer.write_sequences(asm.request, asm.sequences(), asm.options)

    def close(self) -> None:
        """Finish the recording (last rows flushed); idempotent."""
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
