"""The plugin as verl loads it (verl 0.9.1 beside the project, ``devtools.verl_install``,
in a subprocess): ``import verl`` installs it through the ``verl.plugins`` entry point;
a config that names running teachers validates with zero teacher GPUs and builds their
clients without contacting verl's resource pools; one whose teachers verl launches goes
to verl's own manager; under another verl release a running teacher is refused at
start-up naming the setting; verl's v1 trainer sets up its resource pools with no teacher
pool for them. Its client against live teachers:
``test_teacher_client.py``."""

from __future__ import annotations

import json
import subprocess
import sys

from devtools.verl_install import verl_env

#: ARGV: a student model directory. Prints one JSON object of what it saw.
_DRIVER = r"""
import json, sys, types
from pathlib import Path
from hydra import compose, initialize_config_dir
import verl
import verl.experimental.teacher_loop as teacher_loop
from verl.utils.config import omega_conf_to_dataclass
from student_client.integrations.verl import plugin
from devtools.verl_config import distillation_config

installed = teacher_loop.MultiTeacherModelManager is plugin.multi_teacher_model_manager
seen = {"installed": installed}
URL = "topk-distill://127.0.0.1:1"

def config(model_path):
    return distillation_config(sys.argv[1], {"teacher_model": (None, model_path)}, "k3", 8)

served = config(URL)
dc = omega_conf_to_dataclass(served.distillation)
seen["validated"] = {k: [t.num_replicas, t.world_size] for k, t in dc.teacher_models.items()}
clients = plugin.ServedTeachers(plugin.served_teachers(served.distillation)).get_client()
seen["clients"] = {k: [type(c).__name__, c.target] for k, c in clients.items()}

# verl's v1 trainer sets up its resource pools (hydra's compose of its ppo_trainer config)
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import PPOTrainer

def pools(model_path):
    root = str(Path(verl.__file__).parent / "trainer/config")
    overrides = ["distillation.enabled=true", "distillation.n_gpus_per_node=0",
                 "distillation.nnodes=0", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
                 f"distillation.teacher_models.teacher_model.model_path={model_path}",
                 f"actor_rollout_ref.model.path={sys.argv[1]}"]
    with initialize_config_dir(config_dir=root, version_base=None):
        trainer = types.SimpleNamespace(config=compose("ppo_trainer", overrides=overrides))
    try:
        PPOTrainer._init_resource_pool_mgr(trainer)
    except ValueError as e:
        return str(e)
    manager = trainer.resource_pool_manager
    return [manager.resource_pool_spec, manager.mapping[Role.TeacherModel],
            trainer.config.distillation.enabled]

seen["pools"] = pools(URL)
seen["pools_launched"] = pools("Qwen/Qwen3-8B")

calls = []
plugin._VERL_MANAGER = lambda **kw: calls.append(sorted(kw)) or "verl's manager"
launched = config("Qwen/Qwen3-8B")
seen["launched"] = teacher_loop.MultiTeacherModelManager(config=launched, resource_pool="pool")
seen["launched_args"] = calls

verl.__version__ = "0.10.0"
try:
    teacher_loop.MultiTeacherModelManager(config=served, resource_pool=None)
except RuntimeError as e:
    seen["refused"] = str(e)
print(json.dumps(seen))
"""


def test_verl_loads_the_plugin_and_it_routes_configs(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(tiny_model_dir)],
        env=verl_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["installed"]  # by verl's own entry-point loading
    # zero teacher GPUs: verl's config validates, no replica to launch
    assert seen["validated"] == {"default": [0, 0]}
    assert seen["clients"] == {"default": ["VerlTeacherClient", "127.0.0.1:1"]}
    # the trainer reserves no GPU for them: no teacher pool; the role on the global pool
    assert seen["pools"] == [{"global_pool": [1]}, "global_pool", True]
    # a teacher verl launches keeps verl's own rule
    assert seen["pools_launched"] == "config.distillation.n_gpus_per_node must be greater than 0"
    assert seen["launched"] == "verl's manager"
    assert seen["launched_args"] == [["config", "resource_pool"]]
    assert seen["refused"].startswith(
        "distillation.teacher_models.teacher_model.model_path: a running topk-distill "
        "teacher needs verl 0.9.1"
    )
    assert "this is verl 0.10.0" in seen["refused"]
