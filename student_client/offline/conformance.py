"""Static checks, for mypy only: every client satisfies its interface.

Nothing here runs (the module body is behind ``TYPE_CHECKING``); ``mypy student_client``
fails when a client's ``info`` / ``score`` / ``stream`` / ``close`` / ``names`` drifts from
:mod:`student_client.clients.sources`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from student_client.clients.aio import AsyncTeacherClient
    from student_client.clients.blocking import TeacherClient
    from student_client.clients.multi_teacher import AsyncMultiTeacherClient, MultiTeacherClient
    from student_client.clients.sources import AsyncTeacherSource, TeacherSource
    from student_client.offline.multi_replay import MultiReplayClient
    from student_client.offline.replay_client import ReplayClient

    def _blocking(
        a: TeacherClient, b: MultiTeacherClient, c: ReplayClient, d: MultiReplayClient
    ) -> list[TeacherSource]:
        return [a, b, c, d]

    def _asyncio(a: AsyncTeacherClient, b: AsyncMultiTeacherClient) -> list[AsyncTeacherSource]:
        return [a, b]
