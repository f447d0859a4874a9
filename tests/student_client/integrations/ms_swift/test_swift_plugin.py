"""The ms-swift plugin in ms-swift 4.6.0 (a subprocess with swift on the path, loaded as
``--external_plugins`` loads it): swift's own ``_setup_teacher`` builds our client for a
``topk-distill://`` URL with the trainer's template, and every start-up failure is an
error naming the setting before any step. Then the parts that need no swift."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.swift_install import swift_env
from student_client.integrations.ms_swift.plugin import (
    PLUGIN_FILE,
    SUPPORTED_SWIFT,
    check_swift_version,
    teacher_client,
)
from student_client.integrations.ms_swift.teacher_client import SwiftTeacherClient

#: ARGV spec.json out.json: each case's outcome (the client's type and template modes,
#: or the error's type and text).
_DRIVER = r"""
import json, sys, traceback
from pathlib import Path
from types import SimpleNamespace
import swift
from swift.utils import import_external_file
from swift.model import get_processor
from swift.template import get_template
from swift.rlhf_trainers.rollout_mixin import RolloutTrainerMixin

spec = json.loads(Path(sys.argv[1]).read_text())

class Trainer(RolloutTrainerMixin):
    pass

def setup(case):
    processor = get_processor(case["student"], model_type="qwen2", download_model=False)
    template = get_template(processor, template_type="chatml")
    template.set_mode("train")
    t = object.__new__(Trainer)
    t.__dict__.update(
        _teacher_model=None, teacher_model_server=case["server"],
        _teacher_use_disable_adapter=False, args=SimpleNamespace(), template=template,
        accelerator=SimpleNamespace(is_main_process=True, process_index=0),
        gkd_logits_topk=case["topk"])
    t._setup_teacher()
    c = t.teacher_clients[0]
    return {"client": type(c).__name__, "target": c.target, "mode": c._template.mode,
            "trainer_mode": template.mode}

out = {}
real = swift.__version__
swift.__version__ = "4.5.0"
try:
    import_external_file(spec["plugin"])
    out["old_swift"] = {"ok": True}
except Exception as exc:
    out["old_swift"] = {"error": type(exc).__name__, "text": str(exc)}
swift.__version__ = real
import_external_file(spec["plugin"])  # what --external_plugins does
for name, case in spec["cases"].items():
    try:
        out[name] = setup(case)
    except Exception as exc:
        out[name] = {"error": type(exc).__name__, "text": str(exc)}
Path(sys.argv[2]).write_text(json.dumps(out))
"""


def _student_with_another_tokenizer(model_dir: Path, to: Path) -> Path:
    from transformers import AutoTokenizer

    shutil.copytree(model_dir, to)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_tokens(["<not-in-the-teacher>"])
    tok.save_pretrained(to)
    return to


@pytest.mark.vllm
def test_swift_builds_our_client_or_stops_naming_the_setting(
    vllm_teacher, tiny_model_dir, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    url = f"topk-distill://{vllm_teacher.target}"
    other = _student_with_another_tokenizer(tiny_model_dir, tmp_path / "other-student")
    student = str(tiny_model_dir)
    cases = {
        "served": {"student": student, "server": url, "topk": 8},
        "grpo": {"student": student, "server": url, "topk": None},
        "no_host": {"student": student, "server": "topk-distill://", "topk": 8},
        "vocabulary": {"student": str(other), "server": url, "topk": 8},
        "top_k": {"student": student, "server": url, "topk": 300},
    }
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"plugin": str(PLUGIN_FILE), "cases": cases}))
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(spec), str(out)],
        env=swift_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["old_swift"]["error"] == "RuntimeError"
    assert got["old_swift"]["text"].startswith(
        "--external_plugins: topk-distill's ms-swift plugin was checked against ms-swift "
        "4.6.0; this is ms-swift 4.5.0"
    )
    for name in ("served", "grpo"):
        assert got[name] == {
            "client": "SwiftTeacherClient",
            "target": vllm_teacher.target,
            "mode": "vllm",
            "trainer_mode": "train",
        }
    assert got["no_host"]["error"] == "ValueError"
    assert got["no_host"]["text"].startswith("--teacher_model_server: 'topk-distill://' names")
    assert got["vocabulary"]["error"] == "ValueError"
    assert got["vocabulary"]["text"].startswith("--teacher_model_server: the teacher at")
    assert "tokenizer" in got["vocabulary"]["text"]
    assert got["top_k"]["error"] == "ValueError"
    assert got["top_k"]["text"].startswith("--gkd_logits_topk: 300, but the teacher at")


def test_only_the_checked_release_is_accepted() -> None:
    check_swift_version(SUPPORTED_SWIFT[0])
    with pytest.raises(RuntimeError, match=r"^--external_plugins: .* this is ms-swift 4\.7\.0"):
        check_swift_version("4.7.0")


def test_other_urls_stay_with_swift_s_own_client() -> None:
    made: list[dict] = []

    def swift_client(**kwargs: object) -> str:
        made.append(kwargs)
        return "swift's"

    make = teacher_client(swift_client)
    assert make(base_urls=["http://teacher:8000"]) == "swift's"
    assert made == [{"base_urls": ["http://teacher:8000"]}]
    ours = make(base_urls=["topk-distill://a:1,b:2"])
    assert isinstance(ours, SwiftTeacherClient) and ours.target == "a:1,b:2"
    assert len(made) == 1


def test_the_plugin_file_is_alone_in_its_folder() -> None:
    """swift puts the file's folder first on ``sys.path``: nothing there may shadow."""
    assert PLUGIN_FILE.is_file()
    assert sorted(p.name for p in PLUGIN_FILE.parent.glob("*.py")) == [
        "__init__.py",
        PLUGIN_FILE.name,
    ]
