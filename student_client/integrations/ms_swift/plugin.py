"""topk-distill's ms-swift plugin: swift's distillation with running teachers, by URL.

ms-swift imports each file given with ``--external_plugins`` when it reads its arguments,
before it builds the trainer; :data:`PLUGIN_FILE` is this package's, and importing it
calls :func:`install`: the name ``VLLMInferClient`` in swift's
``swift.rlhf_trainers.rollout_mixin`` (which builds one teacher client per
``--teacher_model_server`` URL) becomes :func:`teacher_client`, which makes a
:class:`~student_client.integrations.ms_swift.teacher_client.SwiftTeacherClient` for a
``topk-distill://host:port`` URL and swift's own client otherwise; and
``RolloutTrainerMixin._setup_teacher`` (GKD's and GRPO's) then hands those clients the
trainer's template and checks each teacher (:func:`with_served_teachers`). Nothing else of
swift changes: its request building, routing by tag, ``parse_prompt_logprobs`` and
teacher-output assembly run as they are. ``--teacher_model_server`` keeps its meaning:
one URL, or swift's JSON list of ``{"url", "tags"}``.

It names the ms-swift releases it was checked against (:data:`SUPPORTED_SWIFT`): with
another, :func:`install` raises at start-up, naming ``--external_plugins``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from student_client.integrations.ms_swift.teacher_client import SwiftTeacherClient
from student_client.integrations.teacher_url import served_target

__all__ = [
    "PLUGIN_FILE",
    "SETTING",
    "SUPPORTED_SWIFT",
    "check_swift_version",
    "install",
    "teacher_client",
    "with_served_teachers",
]

#: The file to give ms-swift: ``--external_plugins <PLUGIN_FILE>``.
PLUGIN_FILE = Path(__file__).resolve().parent / "external" / "topk_distill_swift.py"

#: ms-swift releases the plugin was checked against (its tests install the first:
#: ``devtools.swift_install``).
SUPPORTED_SWIFT = ("4.6.0",)

#: swift's setting that names the teachers.
SETTING = "--teacher_model_server"


def check_swift_version(version: str) -> None:
    """Raise ``RuntimeError`` naming ``--external_plugins`` when ``version`` is not in
    :data:`SUPPORTED_SWIFT`."""
    if version not in SUPPORTED_SWIFT:
        raise RuntimeError(
            f"--external_plugins: topk-distill's ms-swift plugin was checked against "
            f"ms-swift {' or '.join(SUPPORTED_SWIFT)}; this is ms-swift {version}. Install "
            f"ms-swift=={SUPPORTED_SWIFT[0]}, or leave the plugin out and give "
            f"{SETTING} a swift teacher server"
        )


def teacher_client(swift_client: Callable[..., Any]) -> Callable[..., Any]:
    """What swift calls as ``VLLMInferClient(base_urls=[url])`` for each teacher: a
    :class:`SwiftTeacherClient` for a ``topk-distill://`` URL, else ``swift_client``."""

    @functools.wraps(swift_client)
    def make(base_urls: list[str] | None = None, **kwargs: Any) -> Any:
        targets = [served_target(url, SETTING) for url in base_urls or []]
        if not targets or None in targets:
            return swift_client(base_urls=base_urls, **kwargs)
        return SwiftTeacherClient(",".join(t for t in targets if t is not None))

    make.topk_distill = True  # type: ignore[attr-defined]
    return make


def with_served_teachers(setup: Callable[[Any], None]) -> Callable[[Any], None]:
    """swift's ``_setup_teacher``, then, for each teacher client that is ours: the
    trainer's template bound to it, and :meth:`SwiftTeacherClient.check` against the
    student's tokenizer and the trainer's top-k (``gkd_logits_topk``; 0 for GRPO's
    actual-token log-probs): a ``ValueError`` naming the setting before any step."""

    @functools.wraps(setup)
    def setup_teacher(trainer: Any) -> None:
        setup(trainer)
        top_k = getattr(trainer, "gkd_logits_topk", None) or 0
        for client in getattr(trainer, "teacher_clients", []):
            if isinstance(client, SwiftTeacherClient):
                client.bind_template(trainer.template)
                client.check(trainer.template.tokenizer, top_k, SETTING)

    setup_teacher.topk_distill = True  # type: ignore[attr-defined]
    return setup_teacher


def install() -> None:
    """Put :func:`teacher_client` and :func:`with_served_teachers` in swift's place
    (idempotent). Raises ``RuntimeError`` naming ``--external_plugins`` under an
    ms-swift release other than :data:`SUPPORTED_SWIFT`."""
    import swift
    from swift.rlhf_trainers import rollout_mixin

    check_swift_version(swift.__version__)
    if not getattr(rollout_mixin.VLLMInferClient, "topk_distill", False):
        rollout_mixin.VLLMInferClient = teacher_client(rollout_mixin.VLLMInferClient)
    mixin = rollout_mixin.RolloutTrainerMixin
    if not getattr(mixin._setup_teacher, "topk_distill", False):
        mixin._setup_teacher = with_served_teachers(mixin._setup_teacher)
