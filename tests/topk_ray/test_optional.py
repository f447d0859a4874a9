"""``ray`` stays optional: the student side and the server import none of it (the import
contract in pyproject.toml checks the code; this checks what a process loads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_student_and_server_load_no_ray() -> None:
    code = (
        "import sys\n"
        "from student_client import TeacherClient, PayloadDataset, ReplayClient, TopKKLLoss\n"
        "import student_client.offline.record_cli, student_client.clients.multi_teacher\n"
        "import teacher_server.server, teacher_server.cli, teacher_server.answer_fingerprint\n"
        "loaded = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "assert not loaded, loaded\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
