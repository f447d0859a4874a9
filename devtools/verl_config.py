"""verl's distillation config as a user writes it, for the verl plugin's tests and
benchmark: verl's own ``trainer/config/distillation/distillation.yaml`` with the keys a
run overrides. Imports verl (``devtools.verl_install.verl_site`` on the path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["distillation_config"]


def distillation_config(
    student: str, teachers: dict[str, tuple[str | None, str]], loss_mode: str, topk: int
) -> Any:
    """The config (an ``OmegaConf`` ``DictConfig``) of a distillation run of the student at
    ``student`` with ``teachers`` (entry name -> routing key, ``model_path``; the entry
    ``teacher_model`` alone is verl's single teacher), verl's ``loss_mode`` and ``topk``,
    and zero teacher GPUs (``n_gpus_per_node = nnodes = 0``)."""
    import verl
    from omegaconf import OmegaConf

    defaults = Path(verl.__file__).parent / "trainer/config/distillation/distillation.yaml"
    rollout = {"name": "vllm", "dtype": "bfloat16", "prompt_length": 2048}
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "model": {"path": student},
                "rollout": {**rollout, "response_length": 2048, "temperature": 1.0},
            },
            "distillation": OmegaConf.load(defaults),
        }
    )
    d = cfg.distillation
    d.pop("defaults")  # hydra's list in the file, not a config key
    d.enabled, d.n_gpus_per_node, d.nnodes = True, 0, 0
    d.distillation_loss.loss_mode = loss_mode
    d.distillation_loss.topk = topk
    base = d.teacher_models.teacher_model
    for name, (key, model_path) in teachers.items():
        d.teacher_models[name] = OmegaConf.merge(base, {"key": key, "model_path": model_path})
    return cfg
