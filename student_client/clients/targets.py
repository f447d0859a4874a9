"""The targets one teacher client talks to: their channels, each one's checked
``GetInfo``, which replicas answer alike, and the retry policy every call of the client
(``info``, ``score``, ``stream``) follows."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from student_client.clients.agreement import ReplicaAgreement, ReplicaDisagreesError
from student_client.clients.channels import backoff_s, give_up, open_channel
from topk_protocol import TeacherInfo, pb, pb_grpc
from topk_protocol.errors import TeacherError
from topk_protocol.status import error_from_rpc

__all__ = ["RetryPolicy", "TargetSet"]

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a client tries again after UNAVAILABLE or a lost
    connection: ``tries`` in all (``retries + 1``), waits doubling from
    ``first_backoff_s`` up to ``max_backoff_s`` (with jitter)."""

    tries: int
    first_backoff_s: float
    max_backoff_s: float

    def wait_s(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failed tries."""
        return backoff_s(failures, self.first_backoff_s, self.max_backoff_s)

    def give_up(self, failures: int, last: TeacherError, targets: Sequence[str]) -> None:
        """Re-raise ``last`` unless it is retryable and fewer than ``tries`` tries failed."""
        give_up(failures, self.tries, last, targets)


@dataclass(frozen=True)
class Connecting:
    """How each target's channel is opened and its calls are sent: TLS credentials (None:
    plaintext), the name verified instead of the host, the largest message in bytes, the
    call metadata (the bearer token) and each call's deadline in seconds."""

    credentials: grpc.ChannelCredentials | None
    tls_server_name: str | None
    max_message_bytes: int
    metadata: tuple[tuple[str, str], ...]
    timeout_s: float


class TargetSet:
    """The targets of one client (``host:port`` each, used round-robin), their stubs
    (opened on first use, inside the running loop) and their ``GetInfo``, checked once
    per target by ``check_info`` (the schema, what the student expects, a student
    tokenizer's view) and against the other replicas."""

    def __init__(
        self,
        targets: list[str],
        connecting: Connecting,
        retry: RetryPolicy,
        check_info: Callable[[str, pb.TeacherInfo], tuple[TeacherInfo, pb.TeacherInfo]],
    ) -> None:
        self.targets = targets
        self.connecting = connecting
        self.retry = retry
        self._check_info = check_info
        self._channels: list[Any] = []
        self._stubs: list[pb_grpc.TeacherStub] = []
        self._infos: dict[int, tuple[TeacherInfo, pb.TeacherInfo]] = {}
        self._agreement = ReplicaAgreement(targets)  # replicas that answer alike
        self._vetting = asyncio.Lock()
        self._rr = itertools.count()
        self._closed = False
        self.current = 0

    def next_index(self) -> int:
        """The target a new call starts at (round-robin)."""
        return next(self._rr) % len(self.targets)

    def stub(self, index: int) -> pb_grpc.TeacherStub:
        """Target ``index``'s stub (every channel opened on the first call)."""
        if self._closed:
            raise TeacherError("client: already closed")
        if not self._stubs:
            c = self.connecting
            for t in self.targets:
                ch = open_channel(t, c.credentials, c.max_message_bytes, c.tls_server_name)
                self._channels.append(ch)
                self._stubs.append(pb_grpc.TeacherStub(ch))
        return self._stubs[index]

    async def _get_info(self, index: int) -> pb.TeacherInfo:
        c = self.connecting
        msg: pb.TeacherInfo = await self.stub(index).GetInfo(
            pb.GetInfoRequest(), timeout=c.timeout_s, metadata=c.metadata
        )
        return msg

    async def fetch_info(self, index: int) -> TeacherInfo:
        """Target ``index``'s checked ``GetInfo`` (asked once)."""
        if index not in self._infos:
            info, msg = self._check_info(self.targets[index], await self._get_info(index))
            self._agreement.check(index, info)
            self._infos[index] = (info, msg)
        return self._infos[index][0]

    def info_message(self, index: int) -> pb.TeacherInfo:
        """Target ``index``'s ``GetInfo`` as its answers are recorded with (fetched)."""
        return self._infos[index][1]

    async def pick(self, index: int) -> int:
        """``index``, or the next target whose answers agree with the other replicas'
        (:mod:`student_client.clients.agreement`; the first call asks every target)."""
        async with self._vetting:
            if not self._agreement.decided:
                answers = await asyncio.gather(
                    *(self._get_info(i) for i in range(len(self.targets))),
                    return_exceptions=True,
                )
                self._agreement.decide(
                    {
                        i: TeacherInfo.from_message(m)
                        for i, m in enumerate(answers)
                        if isinstance(m, pb.TeacherInfo)
                    }
                )
        return self._agreement.usable(index)

    async def call(self, fn: Callable[[int], Awaitable[T]], index: int) -> T:
        """Run ``fn(target_index)`` from ``index`` on, with retries on UNAVAILABLE,
        moving between targets."""
        failures = 0
        while True:
            self.current = index = await self.pick(index)
            try:
                return await fn(index)
            except ReplicaDisagreesError:
                continue  # refused now: pick moves on
            except grpc.RpcError as e:
                failures += 1
                self.retry.give_up(failures, error_from_rpc(e), self.targets)
            await asyncio.sleep(self.retry.wait_s(failures))
            index = (index + 1) % len(self.targets)

    async def close(self) -> None:
        """Close every channel; later calls raise ``TeacherError``."""
        if self._closed:
            return
        self._closed = True
        for channel in self._channels:
            await channel.close()
