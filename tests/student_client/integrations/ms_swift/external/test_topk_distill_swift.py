"""The ``--external_plugins`` file, loaded twice by ms-swift 4.6.0's own loader
(``swift.utils.import_external_file``, what ``--external_plugins`` calls): the plugin is
in place once, swift's names wrapped once."""

from __future__ import annotations

import subprocess
import sys

from devtools.swift_install import swift_env
from student_client.integrations.ms_swift.plugin import PLUGIN_FILE

_DRIVER = r"""
import sys
from swift.utils import import_external_file
from swift.rlhf_trainers import rollout_mixin
import_external_file(sys.argv[1])
first = (rollout_mixin.VLLMInferClient, rollout_mixin.RolloutTrainerMixin._setup_teacher)
import_external_file(sys.argv[1])
import importlib.util
spec = importlib.util.spec_from_file_location("again", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))  # a second copy installs again
second = (rollout_mixin.VLLMInferClient, rollout_mixin.RolloutTrainerMixin._setup_teacher)
print(first == second, first[0].topk_distill, first[1].topk_distill,
      first[0].__wrapped__.__name__, first[1].__wrapped__.__name__)
"""


def test_loading_the_file_installs_the_plugin_once() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(PLUGIN_FILE)],
        env=swift_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["True", "True", "True", "VLLMInferClient", "_setup_teacher"]
