"""A folder of pinned packages beside the project's environment, for a framework the
tests drive in a subprocess (verl, ms-swift): ``pip install --no-deps --target``, once.

Frameworks pin what the project's environment has in other versions (verl
``transformers < 5.11``, ms-swift ``trl < 1``) and ask for GPU packages their teacher
paths never import; such a folder holds exactly what those paths import, pinned, and
leaves the project's environment as it is. A process that puts the folder on
``PYTHONPATH`` after the project (:func:`side_env`) imports the framework with the
project's torch and transformers, and the folder's pins ahead of the environment's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["ROOT", "side_env", "side_site"]

#: The repository root.
ROOT = Path(__file__).resolve().parent.parent


def side_site(
    name: str,
    requirements: Sequence[str],
    cache: Path | None = None,
    then: Callable[[Path], object] | None = None,
) -> Path:
    """The folder ``<cache>/<name>`` (default cache ``.cache/topk-distill``) holding
    ``requirements``, installed there first if missing (then ``then(folder)``). Raises
    ``subprocess.CalledProcessError`` with pip's output if pip fails."""
    site = (cache or ROOT / ".cache" / "topk-distill") / name
    done = site / ".installed"
    if done.exists():
        return site
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
         *requirements],
        check=True,
        capture_output=True,
        text=True,
    )  # fmt: skip
    if then is not None:
        then(site)
    done.write_text("\n".join(requirements) + "\n")
    return site


def side_env(site: Path) -> dict[str, str]:
    """This process's environment with the project, then ``site``, on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}"}
