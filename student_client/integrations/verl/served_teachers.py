"""verl's teacher manager for teachers that already run: clients by URL, no replicas.

verl builds its teachers with ``MultiTeacherModelManager(config, resource_pool)``
(``verl.experimental.teacher_loop``): one set of vLLM or SGLang replicas per entry of
``distillation.teacher_models``, on GPUs reserved for them, and hands the trainer
``get_client()``, one client per teacher key. :class:`ServedTeachers` takes its place when
the entries' ``model_path`` name running topk-distill teachers (:data:`SCHEME`, e.g.
``topk-distill://teacher-host:50051``; several targets, comma-separated, for fail-over):
it launches nothing, needs no resource pool, and its clients are
:class:`~student_client.integrations.verl.teacher_client.VerlTeacherClient`.

The URL goes in ``model_path`` rather than a new key or an environment variable: verl's
config classes refuse keys they do not know, ``model_path`` is the one setting that says
which teacher each entry is (next to its routing ``key``), and a config value reaches
every Ray worker verl starts, which an environment variable of the driver does not.

Before the first step it checks each teacher (:meth:`ServedTeachers.check`): it answers,
its tokenizer is the student's (``actor_rollout_ref.model``'s tokenizer, by
:func:`topk_protocol.info.tokenizer_fingerprint`), it serves temperature 1 and at least
verl's top-k; a failure raises ``ValueError`` naming the setting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from student_client.integrations.teacher_url import SCHEME, served_target
from student_client.integrations.verl.teacher_client import VerlTeacherClient
from topk_protocol.errors import TeacherError
from topk_protocol.info import TeacherInfo, tokenizer_fingerprint

__all__ = ["ServedTeacher", "ServedTeachers", "served_teachers"]


@dataclass(frozen=True)
class ServedTeacher:
    """One entry of ``distillation.teacher_models`` that names a running teacher."""

    #: The config path of its ``model_path``, for messages.
    setting: str
    #: verl's routing key (``distillation.teacher_key``'s value for its samples).
    key: str
    target: str


def served_teachers(distillation: Mapping[str, Any]) -> list[ServedTeacher]:
    """The entries of ``distillation.teacher_models`` (verl's raw config, before its
    dataclass renames a single teacher's key to ``default``) that name running teachers.
    Raises ``ValueError`` naming the setting where some do and some do not."""
    entries = dict(distillation.get("teacher_models") or {})
    if len(entries) > 1:
        entries.pop("teacher_model", None)  # verl drops its default entry when there are several
    out, launched = [], []
    for name, entry in entries.items():
        setting = f"distillation.teacher_models.{name}.model_path"
        target = served_target(entry.get("model_path"), setting)
        if target is None:
            launched.append(setting)
            continue
        key = "default" if len(entries) == 1 else str(entry.get("key"))
        out.append(ServedTeacher(setting, key, target))
    if out and launched:
        raise ValueError(
            f"{launched[0]}: every teacher must be a running topk-distill teacher "
            f"({SCHEME}host:port) or none (verl launches them), not a mix"
        )
    return out


class ServedTeachers:
    """Takes the place of verl's ``MultiTeacherModelManager`` for running teachers.

    Args:
        teachers: :func:`served_teachers` of verl's ``distillation`` config.
        **options: every client's options (:class:`VerlTeacherClient`).
    """

    def __init__(self, teachers: list[ServedTeacher], **options: Any) -> None:
        self.teachers = teachers
        self._options = options

    def get_client(self) -> dict[str, VerlTeacherClient]:
        """One client per teacher key, as verl's manager gives."""
        return {t.key: VerlTeacherClient(t.target, **self._options) for t in self.teachers}

    def check(self, student_tokenizer: Any, top_k: int) -> dict[str, TeacherInfo]:
        """Each teacher answers, tokenizes as ``student_tokenizer`` does, serves
        temperature 1 and ``top_k`` (0: the actual token only); their announced info by
        key. Raises ``ValueError`` naming the setting."""
        fingerprint = tokenizer_fingerprint(student_tokenizer)
        return asyncio.run(self._check_all(fingerprint, top_k))

    async def _check_all(self, fingerprint: str, top_k: int) -> dict[str, TeacherInfo]:
        infos = {}
        for teacher in self.teachers:
            client = VerlTeacherClient(
                teacher.target, expect_tokenizer_fingerprint=fingerprint, **self._options
            )
            try:
                infos[teacher.key] = await client.client.info()
            except TeacherError as exc:
                raise ValueError(
                    f"{teacher.setting}: the teacher at {teacher.target}: {exc}"
                ) from exc
            finally:
                await client.close()
            if top_k > infos[teacher.key].max_top_k:
                raise ValueError(
                    f"distillation.distillation_loss.topk: {top_k}, but the teacher at "
                    f"{teacher.target} ({teacher.setting}) serves at most "
                    f"{infos[teacher.key].max_top_k}"
                )
        return infos
