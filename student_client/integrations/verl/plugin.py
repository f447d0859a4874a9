"""topk-distill's verl plugin: verl's distillation with running teachers, by URL.

verl imports every entry point of the group ``verl.plugins`` on ``import verl``
(``verl/__init__.py``); this module is this package's (``topk_distill``, installed with
``pip install 'topk-distill[verl]'``), and importing it is what installs it: verl's
``MultiTeacherModelManager`` (``verl.experimental.teacher_loop``, which its trainers call
to build their teachers) becomes :func:`multi_teacher_model_manager`, which builds
:class:`~student_client.integrations.verl.served_teachers.ServedTeachers` when
``distillation.teacher_models.*.model_path`` names running topk-distill teachers
(``topk-distill://host:port``) and verl's own manager otherwise; and verl's v1 trainer
(``verl.trainer.ppo.main_ppo``'s) sets up its resource pools without a teacher pool for
them (:func:`without_teacher_pool`: verl would refuse ``distillation.n_gpus_per_node=0``
and reserve GPUs for replicas it no longer launches). Nothing else of verl changes.

It names the verl releases it was checked against
(:mod:`~student_client.integrations.verl.versions`): with another, a config that names a
running teacher stops at start-up with a ``RuntimeError`` saying so, before any step; a
config whose teachers verl launches itself is left alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from student_client.integrations.verl.import_hooks import when_imported
from student_client.integrations.verl.served_teachers import ServedTeachers, served_teachers
from student_client.integrations.verl.versions import SUPPORTED_VERL, check_verl_version

__all__ = ["install", "multi_teacher_model_manager", "without_teacher_pool"]

#: verl's v1 trainer, whose resource-pool setup :func:`without_teacher_pool` wraps.
TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"

log = logging.getLogger(__name__)


def multi_teacher_model_manager(config: Any, resource_pool: Any = None) -> Any:
    """What verl's trainers call as ``MultiTeacherModelManager(config=...,
    resource_pool=...)``: :class:`ServedTeachers` (checked, see
    :meth:`ServedTeachers.check`) for running teachers, else verl's own manager."""
    import verl
    from transformers import AutoTokenizer

    teachers = served_teachers(config.distillation)
    if not teachers:
        return _VERL_MANAGER(config=config, resource_pool=resource_pool)
    check_verl_version(verl.__version__, teachers[0].setting)
    model = config.actor_rollout_ref.model
    tokenizer_path = model.get("tokenizer_path") or model.path
    tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_path, trust_remote_code=bool(model.get("trust_remote_code", False))
    )
    loss = config.distillation.get("distillation_loss") or {}
    served = ServedTeachers(teachers)
    served.check(tokenizer, _top_k(loss))
    return served


def _top_k(loss: Any) -> int:
    """The K verl's loss asks its teacher for: ``topk`` where the loss mode uses a top-k,
    else 0 (the actual token)."""
    from verl.trainer.distillation.losses import get_distillation_loss_settings

    settings = get_distillation_loss_settings(loss.get("loss_mode", "k3"))
    return int(loss.get("topk") or 0) if settings.use_topk else 0


#: verl's own manager, kept for the teachers it launches.
_VERL_MANAGER: Any = None


def without_teacher_pool(setup: Callable[[Any], None]) -> Callable[[Any], None]:
    """verl's trainer's ``_init_resource_pool_mgr``, which for running teachers builds the
    pools as if distillation were off (no ``teacher_pool``: no GPU reserved) and then maps
    the teacher role to the trainer's global pool, which verl hands the teacher manager
    and :class:`ServedTeachers` never uses."""

    @functools.wraps(setup)
    def init_resource_pool_mgr(trainer: Any) -> None:
        from omegaconf import read_write
        from verl.trainer.ppo.utils import Role

        distillation = trainer.config.distillation
        if not distillation.get("enabled") or not served_teachers(distillation):
            setup(trainer)
            return
        with read_write(distillation):
            distillation.enabled = False
        try:
            setup(trainer)
        finally:
            with read_write(distillation):
                distillation.enabled = True
        trainer.mapping[Role.TeacherModel] = "global_pool"

    init_resource_pool_mgr.topk_distill = True  # type: ignore[attr-defined]
    return init_resource_pool_mgr


def _patch_trainer(module: ModuleType) -> None:
    trainer = module.PPOTrainer
    if not getattr(trainer._init_resource_pool_mgr, "topk_distill", False):
        trainer._init_resource_pool_mgr = without_teacher_pool(trainer._init_resource_pool_mgr)


def install() -> None:
    """Put :func:`multi_teacher_model_manager` in verl's place (idempotent). Where verl has
    no such manager (another release), logs an error and changes nothing: verl hides a
    plugin's exceptions."""
    global _VERL_MANAGER
    try:
        import verl.experimental.teacher_loop as teacher_loop

        current = teacher_loop.MultiTeacherModelManager
    except (ImportError, AttributeError) as exc:
        log.error(
            "topk-distill's verl plugin is not installed (%s): teacher model paths "
            "topk-distill://... will not work; the plugin was checked against verl %s",
            exc,
            " or ".join(SUPPORTED_VERL),
        )
        return
    if current is multi_teacher_model_manager:
        return
    _VERL_MANAGER = current
    teacher_loop.MultiTeacherModelManager = multi_teacher_model_manager
    when_imported(TRAINER_MODULE, _patch_trainer)


install()
