"""``teacher-server`` (``teacher_server.__main__``): without the server extra, one line
naming the extra and exit code 2; the old entry point still works, with a warning."""

from __future__ import annotations

import subprocess
import sys

# Makes ``import uvicorn`` fail as in an environment where it is not installed.
HIDE_UVICORN = (
    "import sys; sys.modules['uvicorn'] = None; "
    "from teacher_server.__main__ import main; sys.exit(main(['serve', '--help']))"
)


def test_missing_server_extra_is_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-c", HIDE_UVICORN], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "pip install 'topk-distill[server]'" in lines[0] and "uvicorn" in lines[0]
