"""``TeacherClient``: fetch top-k payloads from a teacher over gRPC (blocking API).

- ``score`` answers one batch (unary ``Score``, or ``ScoreStream`` when the answer would
  not fit in one message);
- ``stream`` keeps ``depth`` requests in flight on one ``ScoreStream`` and yields the
  payloads in input order, so the teacher works while the student computes;
- retries with backoff on UNAVAILABLE and on a connection lost mid-stream (unanswered
  requests are re-sent, to the next target when there are several; a batch is neither
  lost nor yielded twice); per-request deadline; typed exceptions
  (:mod:`student_client.errors`);
- ``record_to=`` records every answered request (:mod:`student_client.recording`).

The asyncio twin is :class:`student_client.aio_client.AsyncTeacherClient`; the pieces
both share (targets, channels, the stream window) live here.
"""

from __future__ import annotations

import itertools
import queue
import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from student_client._closeable import Closeable
from student_client.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    TeacherError,
    TeacherUnavailableError,
    VocabMismatchError,
    error_from_rpc,
)
from student_client.payload import (
    ResponseAssembler,
    TeacherInfo,
    TeacherPayload,
    build_request,
)
from student_client.recording import RecordingWriter
from student_client.wire import pb, pb_grpc

__all__ = ["ScoreBatch", "TeacherClient", "parse_targets"]

#: Room left for protobuf framing when deciding whether an answer fits in one message.
_FRAMING_BYTES = 64
_END = object()  # the server closed the stream
_STOP = object()  # no more requests on this stream


@dataclass(frozen=True)
class ScoreBatch:
    """One item of :meth:`TeacherClient.stream` when positions are needed: the batch's
    ``sequences`` and one ``(start, end)`` per sequence (or None for every position)."""

    sequences: Any
    positions: Sequence[tuple[int, int]] | None = None


def parse_targets(target: str | Sequence[str]) -> list[str]:
    """``"host:port"``, ``"dns:///name:port"``, ``"h1:p1,h2:p2"`` or a list -> targets."""
    if isinstance(target, str):
        items = [target] if target.startswith("dns:") else target.split(",")
    else:
        items = list(target)
    out = [t.strip() for t in items if isinstance(t, str) and t.strip()]
    if not out or len(out) != len(items):
        raise ValueError(f"target: expected host:port, dns:///name:port or a list, got {target!r}")
    return out


def _channel_options(target: str, max_message_bytes: int, tls_server_name: str | None) -> list:
    opts: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if target.startswith("dns:"):
        # One subchannel per resolved address, calls spread over them.
        opts.append(("grpc.lb_policy_name", "round_robin"))
    if tls_server_name:
        opts.append(("grpc.ssl_target_name_override", tls_server_name))
    return opts


def _credentials(tls: bool | bytes | str | Path | None) -> grpc.ChannelCredentials | None:
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    pem = tls if isinstance(tls, bytes) else Path(tls).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=pem)


def _is_retryable(err: TeacherError) -> bool:
    return isinstance(err, TeacherUnavailableError)


class _ClientCore:
    """Configuration and policy shared by the blocking and the asyncio client."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        token: str | None,
        tls: bool | bytes | str | Path | None,
        tls_server_name: str | None,
        timeout_s: float,
        max_message_mb: int,
        retries: int,
        backoff_s: float,
        max_backoff_s: float,
        expect_vocab_size: int | None,
        expect_tokenizer_fingerprint: str | None,
        record_to: str | Path | None,
        record_compression: str,
        record_metadata: dict[str, Any] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"retries: must be >= 0, got {retries}")
        if max_message_mb < 1:
            raise ValueError(f"max_message_mb: must be >= 1, got {max_message_mb}")
        self.targets = parse_targets(target)
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self.credentials = _credentials(tls)
        self.tls_server_name = tls_server_name
        self.timeout_s = float(timeout_s)
        self.max_message_bytes = int(max_message_mb) * 1024 * 1024
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.expect_vocab_size = expect_vocab_size
        self.expect_fingerprint = expect_tokenizer_fingerprint
        self.record_to = Path(record_to) if record_to is not None else None
        self.record_compression = record_compression
        self.record_metadata = dict(record_metadata or {})
        self.recorder: RecordingWriter | None = None
        self.infos: dict[int, TeacherInfo] = {}
        self.current = 0
        self._rr = itertools.count()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self.lock = threading.Lock()

    def call_timeout(self, timeout_s: float | None) -> float:
        """A call's deadline: its own ``timeout_s`` or the client's."""
        if timeout_s is None:
            return self.timeout_s
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        return float(timeout_s)

    @property
    def tries(self) -> int:
        return self.retries + 1

    def channel_options(self, target: str) -> list:
        return _channel_options(target, self.max_message_bytes, self.tls_server_name)

    def new_request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def next_target(self) -> int:
        """Round robin over the targets, one step per new call."""
        return next(self._rr) % len(self.targets)

    def fail_over(self, index: int) -> int:
        """The target to try after ``index`` failed."""
        return (index + 1) % len(self.targets)

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before try ``attempt + 1`` (exponential, with jitter)."""
        base = min(self.max_backoff_s, self.backoff_s * (2**attempt))
        return base * (0.5 + random.random() / 2)

    def unavailable(self, tries: int, last: TeacherError) -> TeacherUnavailableError:
        return TeacherUnavailableError(
            f"teacher unavailable after {tries} tries ({', '.join(self.targets)}): {last.message}",
            grpc.StatusCode.UNAVAILABLE,
        )

    def check_info(self, info: TeacherInfo, target: str) -> None:
        """Raise unless the teacher speaks our schema and has the expected vocabulary."""
        info.check_schema()
        problems = []
        if self.expect_vocab_size is not None and info.vocab_size != self.expect_vocab_size:
            problems.append(
                f"vocab_size: the teacher has {info.vocab_size}, "
                f"the student expects {self.expect_vocab_size}"
            )
        if (
            self.expect_fingerprint is not None
            and info.tokenizer_fingerprint != self.expect_fingerprint
        ):
            problems.append(
                f"tokenizer_fingerprint: the teacher has {info.tokenizer_fingerprint!r}, "
                f"the student expects {self.expect_fingerprint!r}"
            )
        if problems:
            raise VocabMismatchError(f"teacher {target}: " + "; ".join(problems))

    def needs_stream(self, request: pb.ScoreRequest, info: TeacherInfo) -> bool:
        """True when the answer may not fit in one message (ours or the server's limit)."""
        size = ResponseAssembler(request).response_bytes()
        size += _FRAMING_BYTES * (len(request.sequences) + 1)
        limit = min(self.max_message_bytes, info.max_message_bytes or self.max_message_bytes)
        return size > limit

    def record(self, info: TeacherInfo, msg: pb.TeacherInfo, asm: ResponseAssembler) -> None:
        """Write one answered request to the recording (when recording)."""
        if self.record_to is None or asm.error is not None:
            return
        with self.lock:
            if self.recorder is None:
                self.recorder = RecordingWriter(
                    self.record_to,
                    msg,
                    compression=self.record_compression,
                    metadata={"targets": self.targets, **self.record_metadata},
                )
        self.recorder.write(asm.request, asm.merged_response())

    def close_recorder(self) -> None:
        with self.lock:
            if self.recorder is not None:
                self.recorder.close()
                self.recorder = None


def request_from_batch(
    core: _ClientCore,
    batch: Any,
    top_k: int,
    dtype: str | int,
    include_sampled: bool,
) -> pb.ScoreRequest | TeacherError:
    """One stream item (a batch of sequences or a :class:`ScoreBatch`) -> ScoreRequest,
    or the :class:`InvalidRequestError` it causes (raised when the caller reaches it)."""
    if isinstance(batch, ScoreBatch):
        sequences, positions = batch.sequences, batch.positions
    else:
        sequences, positions = batch, None
    try:
        return build_request(
            sequences,
            top_k,
            dtype=dtype,
            positions=positions,
            include_sampled=include_sampled,
            request_id=core.new_request_id(),
        )
    except InvalidRequestError as e:
        return e


class _Pending:
    """A request of a stream that has been sent and not yet handed to the caller."""

    __slots__ = ("assembler", "sent_at")

    def __init__(self, request: pb.ScoreRequest) -> None:
        self.assembler = ResponseAssembler(request)
        self.sent_at = time.monotonic()

    @property
    def request(self) -> pb.ScoreRequest:
        return self.assembler.request


class _RetryStream(Exception):
    """Internal: a request was refused with UNAVAILABLE inside a stream (server loading or
    draining); reconnect and re-send."""

    def __init__(self, error: TeacherError) -> None:
        super().__init__(error.message)
        self.error = error


class _StreamWindow:
    """The requests of one logical stream that are sent and not yet yielded, in order.

    Sans-IO: the drivers (blocking and asyncio) feed it server messages with
    :meth:`route` and take completed requests from the head with :meth:`pop`.
    """

    def __init__(self) -> None:
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._local = itertools.count()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request: pb.ScoreRequest) -> _Pending:
        if request.request_id in self._pending:
            raise TeacherError(f"request_id: {request.request_id!r} is already in flight")
        pending = _Pending(request)
        self._pending[request.request_id] = pending
        return pending

    def add_failed(self, error: TeacherError) -> None:
        """A batch refused before sending: it fails when the caller reaches it."""
        pending = _Pending(pb.ScoreRequest(request_id=f"!local-{next(self._local)}"))
        pending.assembler.error = error
        pending.assembler.complete = True
        self._pending[pending.request.request_id] = pending

    def head(self) -> _Pending:
        return next(iter(self._pending.values()))

    def pop(self) -> _Pending:
        return self._pending.popitem(last=False)[1]

    def route(self, msg: pb.ScoreResponse) -> bool:
        """Take one server message; True when it completed a request."""
        pending = self._pending.get(msg.request_id)
        if pending is None:
            raise TeacherError(
                f"teacher answered request_id {msg.request_id!r}, which is not in flight"
            )
        pending.assembler.add(msg)
        err = pending.assembler.error
        if err is not None and _is_retryable(err):
            pending.assembler.reset()
            raise _RetryStream(err)
        return pending.assembler.complete

    def unanswered(self) -> list[_Pending]:
        """Requests not completely answered, in order, reset for sending again."""
        out = [p for p in self._pending.values() if not p.assembler.complete]
        for p in out:
            p.assembler.reset()
            p.sent_at = time.monotonic()
        return out


class _BlockingStream:
    """One ``ScoreStream`` call: requests go through a queue, a thread reads answers."""

    def __init__(self, stub: pb_grpc.TeacherStub, metadata: Sequence[tuple[str, str]]) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        self._out: queue.Queue[Any] = queue.Queue()
        self._call = stub.ScoreStream(self._request_iter(), metadata=metadata)
        self._thread = threading.Thread(target=self._read, daemon=True, name="teacher-stream")
        self._thread.start()

    def _request_iter(self) -> Iterator[pb.ScoreRequest]:
        while (item := self._requests.get()) is not _STOP:
            yield item

    def _read(self) -> None:
        try:
            for msg in self._call:
                self._out.put(msg)
            self._out.put(_END)
        except grpc.RpcError as e:
            self._out.put(e)

    def send(self, request: pb.ScoreRequest) -> None:
        self._requests.put(request)

    def get(self, timeout: float) -> Any:
        """The next server message, ``_END``, or a ``grpc.RpcError``; raises queue.Empty."""
        return self._out.get(timeout=max(timeout, 0.0))

    def close(self) -> None:
        self._requests.put(_STOP)
        self._call.cancel()
        self._thread.join(timeout=5)


class TeacherClient(Closeable):
    """Blocking client of a ``topk_distill.v1.Teacher`` service.

    Args:
        target: ``"host:port"``; ``"dns:///name:port"`` (gRPC resolves it and spreads
            calls round-robin over every address); or a list (or comma-separated string)
            of ``host:port``, used round-robin, moving to the next one on failure.
        token: shared bearer token, sent as ``authorization: Bearer <token>``.
        tls: None/False for plaintext, True for TLS with the system roots, or the root
            certificate (PEM bytes or a path).
        tls_server_name: name to verify in the server certificate instead of the host.
        timeout_s: deadline of each call; in a stream, of each request from the moment
            it is sent.
        max_message_mb: largest message this client sends or receives.
        retries: extra tries after an UNAVAILABLE error or a lost connection.
        backoff_s, max_backoff_s: first and largest wait between tries (doubling).
        expect_vocab_size, expect_tokenizer_fingerprint: checked against ``GetInfo``
            before the first request to a target; a mismatch raises VocabMismatchError.
        record_to: record every answered sequence to this recording directory
            (:mod:`student_client.recording`; K and dtype of the first request).
        record_compression: ``"auto"`` (zstd), ``"zstd"``, ``"lz4"`` or ``"none"``.
        record_metadata: extra JSON metadata for the recording's ``metadata.json``.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        token: str | None = None,
        tls: bool | bytes | str | Path | None = None,
        tls_server_name: str | None = None,
        timeout_s: float = 120.0,
        max_message_mb: int = 64,
        retries: int = 4,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        expect_vocab_size: int | None = None,
        expect_tokenizer_fingerprint: str | None = None,
        record_to: str | Path | None = None,
        record_compression: str = "auto",
        record_metadata: dict[str, Any] | None = None,
    ) -> None:
        self._core = _ClientCore(
            target,
            token=token,
            tls=tls,
            tls_server_name=tls_server_name,
            timeout_s=timeout_s,
            max_message_mb=max_message_mb,
            retries=retries,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            expect_vocab_size=expect_vocab_size,
            expect_tokenizer_fingerprint=expect_tokenizer_fingerprint,
            record_to=record_to,
            record_compression=record_compression,
            record_metadata=record_metadata,
        )
        core = self._core
        self._channels: list[grpc.Channel] = []
        for t in core.targets:
            opts = core.channel_options(t)
            if core.credentials is None:
                self._channels.append(grpc.insecure_channel(t, options=opts))
            else:
                self._channels.append(grpc.secure_channel(t, core.credentials, options=opts))
        self._stubs = [pb_grpc.TeacherStub(c) for c in self._channels]
        self._info_msgs: dict[int, pb.TeacherInfo] = {}
        self._closed = False

    # -- targets and info -------------------------------------------------------------
    @property
    def targets(self) -> list[str]:
        return list(self._core.targets)

    @property
    def current_target(self) -> str:
        """The target the latest call went to."""
        return self._core.targets[self._core.current]

    def _fetch_info(self, index: int) -> TeacherInfo:
        core = self._core
        if index not in core.infos:
            msg = self._stubs[index].GetInfo(
                pb.GetInfoRequest(), timeout=core.timeout_s, metadata=core.metadata
            )
            info = TeacherInfo.from_message(msg)
            core.check_info(info, core.targets[index])
            self._info_msgs[index] = msg
            core.infos[index] = info
        return core.infos[index]

    def _call(self, fn: Any, index: int | None = None) -> Any:
        """Run ``fn(target_index)`` with retries on UNAVAILABLE, moving between targets."""
        core = self._core
        index = core.next_target() if index is None else index
        last: TeacherError | None = None
        for attempt in range(core.tries):
            core.current = index
            try:
                return fn(index)
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                if not _is_retryable(err):
                    raise err from None
                last = err
            if attempt + 1 < core.tries:
                time.sleep(core.backoff(attempt))
                index = core.fail_over(index)
        assert last is not None
        raise core.unavailable(core.tries, last)

    def info(self) -> TeacherInfo:
        """The teacher's ``GetInfo`` (checked against the expected vocabulary)."""
        self._check_open()
        info: TeacherInfo = self._call(self._fetch_info, self._core.current)
        return info

    # -- score ------------------------------------------------------------------------
    def score(
        self,
        sequences: Any,
        top_k: int,
        *,
        dtype: str = "float16",
        positions: Sequence[tuple[int, int]] | None = None,
        include_sampled: bool = True,
        device: torch.device | str = "cpu",
        timeout_s: float | None = None,
    ) -> TeacherPayload:
        """Score one batch; returns ``[B, S, K]`` tensors (see :class:`TeacherPayload`).

        Args:
            sequences: ``[B, L]`` tensor/array or a list of 1-D token id sequences.
            top_k: K.
            dtype: wire dtype of the log-probs (``float16``, ``bfloat16``, ``float32``);
                the payload holds them widened to float32.
            positions: None (every position) or ``(start, end)`` per sequence.
            include_sampled: also fetch the log-prob of the actual next token.
            device: where the tensors go.
            timeout_s: this call's deadline (default: the client's).
        """
        self._check_open()
        request = build_request(
            sequences,
            top_k,
            dtype=dtype,
            positions=positions,
            include_sampled=include_sampled,
            request_id=self._core.new_request_id(),
        )
        return self._score_request(request, device, self._core.call_timeout(timeout_s))

    def _score_request(
        self, request: pb.ScoreRequest, device: torch.device | str, timeout: float
    ) -> TeacherPayload:
        core = self._core

        def unary(index: int) -> ResponseAssembler:
            info = self._fetch_info(index)
            asm = ResponseAssembler(request)
            asm.add(self._stubs[index].Score(request, timeout=timeout, metadata=core.metadata))
            core.record(info, self._info_msgs[index], asm)
            return asm

        index = core.next_target()
        info = self._call(self._fetch_info, index)
        if core.needs_stream(request, info):
            gen = self._run_stream(iter([request]), depth=0, device=device, timeout_s=timeout)
            try:
                return next(gen)
            finally:
                gen.close()
        asm: ResponseAssembler = self._call(unary, core.current)
        return asm.payload(device)

    # -- stream -----------------------------------------------------------------------
    def stream(
        self,
        batches: Iterable[Any],
        top_k: int,
        *,
        depth: int = 4,
        dtype: str = "float16",
        include_sampled: bool = True,
        device: torch.device | str = "cpu",
        timeout_s: float | None = None,
    ) -> Iterator[TeacherPayload]:
        """Payloads of ``batches``, in input order, with ``depth`` requests in flight.

        ``batches`` yields batches of sequences (as for :meth:`score`) or
        :class:`ScoreBatch` items (with positions); it is consumed lazily, at most
        ``depth`` batches ahead of the payload the caller holds. While the caller works on
        payload ``n``, requests ``n+1 .. n+depth`` are with the teacher (``depth=0``: none,
        every request waits for the caller). A request the teacher refused raises its
        typed exception when the caller reaches that batch, which ends the iteration.
        """
        self._check_open()
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"depth: expected an int >= 0, got {depth!r}")
        core = self._core
        requests = (request_from_batch(core, b, top_k, dtype, include_sampled) for b in batches)
        return self._run_stream(
            requests, depth=depth, device=device, timeout_s=core.call_timeout(timeout_s)
        )

    def _open_stream(self, index: int) -> _BlockingStream:
        self._fetch_info(index)
        return _BlockingStream(self._stubs[index], self._core.metadata)

    def _run_stream(
        self,
        requests: Iterator[pb.ScoreRequest | TeacherError],
        *,
        depth: int,
        device: torch.device | str,
        timeout_s: float,
    ) -> Generator[TeacherPayload, None, None]:
        core = self._core
        window = _StreamWindow()
        index = core.next_target()
        conn: _BlockingStream | None = None
        exhausted = False
        failures = 0
        last: TeacherError | None = None

        def fill(limit: int) -> None:
            nonlocal exhausted
            while not exhausted and len(window) < limit:
                request = next(requests, None)
                if request is None:
                    exhausted = True
                    return
                if isinstance(request, TeacherError):
                    window.add_failed(request)
                    continue
                window.add(request)
                assert conn is not None
                conn.send(request)

        try:
            while True:
                if conn is None:
                    if failures:
                        if failures >= core.tries:
                            assert last is not None
                            raise core.unavailable(failures, last)
                        time.sleep(core.backoff(failures - 1))
                        index = core.fail_over(index)
                    core.current = index
                    try:
                        conn = self._open_stream(index)
                    except grpc.RpcError as e:
                        last = error_from_rpc(e)
                        if not _is_retryable(last):
                            raise last from None
                        failures += 1
                        continue
                    for pending in window.unanswered():
                        conn.send(pending.request)
                fill(max(depth, 1))
                if not window:
                    return
                head = window.head()
                if head.assembler.complete:
                    window.pop()
                    if head.assembler.error is not None:
                        raise head.assembler.error
                    fill(depth)
                    core.record(core.infos[index], self._info_msgs[index], head.assembler)
                    yield head.assembler.payload(device)
                    continue
                wait = head.sent_at + timeout_s - time.monotonic()
                try:
                    item = conn.get(wait)
                except queue.Empty:
                    raise DeadlineExceededError(
                        f"request {head.request.request_id}: no complete answer within "
                        f"timeout_s {timeout_s} s",
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                    ) from None
                if item is _END or isinstance(item, grpc.RpcError):
                    last = (
                        error_from_rpc(item)
                        if isinstance(item, grpc.RpcError)
                        else TeacherUnavailableError("the teacher closed the stream early")
                    )
                    if not _is_retryable(last):
                        raise last from None
                else:
                    try:
                        if window.route(item):
                            failures = 0
                        continue
                    except _RetryStream as e:
                        last = e.error
                # Connection lost (or the teacher refused with UNAVAILABLE): reconnect.
                failures += 1
                conn.close()
                conn = None
        finally:
            if conn is not None:
                conn.close()

    # -- lifecycle --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TeacherError("client: already closed")

    def close(self) -> None:
        """Close the channels and finish the recording (last rows flushed)."""
        if self._closed:
            return
        self._closed = True
        self._core.close_recorder()
        for channel in self._channels:
            channel.close()
