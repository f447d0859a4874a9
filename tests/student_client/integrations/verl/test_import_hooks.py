"""``when_imported``: a patch runs right after a module's first import, or at once when
it is already imported, and the finder leaves ``sys.meta_path`` as it found it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from student_client.integrations.verl.import_hooks import when_imported


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package ``hooked_pkg`` with a submodule ``mod`` (``VALUE = 1``), importable."""
    root = tmp_path / "hooked_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "hooked_pkg.mod"
    for name in ("hooked_pkg.mod", "hooked_pkg"):
        sys.modules.pop(name, None)


def test_the_patch_runs_after_the_first_import_and_the_finder_goes(package: str) -> None:
    seen: list[int] = []

    def patch(module: ModuleType) -> None:
        seen.append(module.VALUE)
        module.VALUE = 2

    finders = list(sys.meta_path)
    when_imported(package, patch)
    assert seen == [] and package not in sys.modules  # nothing imported yet
    module = importlib.import_module(package)
    assert seen == [1] and module.VALUE == 2  # run once the module's code ran
    assert sys.meta_path == finders
    importlib.import_module(package)
    assert seen == [1]  # once


def test_an_imported_module_is_patched_at_once(package: str) -> None:
    module = importlib.import_module(package)
    when_imported(package, lambda m: setattr(m, "VALUE", 3))
    assert module.VALUE == 3
