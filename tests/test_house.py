"""The house rules a newcomer relies on, checked on the code itself: no import circle in
the project's packages (type-checking imports included), no production function over 80
lines, and a test file that mirrors each module, or a line in docs/design.md that says
where it is tested (docs/design.md, "House rules")."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping

import grimp

from tests.conftest import ROOT

PACKAGES = ("student_client", "teacher_server", "topk_protocol", "topk_ray")
MAX_FUNCTION_LINES = 80


def import_circles(imports: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import circles of a module graph (``imports[m]``: what ``m`` imports
    directly): each strongly connected set of more than one module, or a module that
    imports itself, sorted (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(sorted(imports[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(imports.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1 or node in imports.get(node, ()):
                    circles.append(sorted(members))
    return sorted(circles)


def test_the_circle_finder_finds_circles_and_nothing_else() -> None:
    graph = {
        "a": ["b"],
        "b": ["c"],
        "c": ["a", "d"],
        "d": [],
        "e": ["e"],
        "f": ["d", "g"],
        "g": ["f"],
    }
    assert import_circles(graph) == [["a", "b", "c"], ["e"], ["f", "g"]]
    assert import_circles({"a": ["b"], "b": ["c"], "c": []}) == []


def test_no_import_circle_in_the_packages() -> None:
    """Every import counts, those under ``if TYPE_CHECKING:`` and inside functions too: a
    circle is one either way for a reader who follows it."""
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False)
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    assert imports["student_client.clients.aio"]  # the graph holds the imports
    assert import_circles(imports) == []


def _functions(tree: ast.AST) -> Iterable[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def test_no_production_function_is_over_80_lines() -> None:
    """Counted from ``def`` to the last line, docstring included."""
    long = []
    files = [f for package in PACKAGES for f in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 100
    for path in files:
        if "_generated" in path.parts:
            continue
        for fn in _functions(ast.parse(path.read_text(), str(path))):
            assert fn.end_lineno is not None
            lines = fn.end_lineno - fn.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}: {lines} lines")
    assert long == []


#: The packages whose modules each have a mirrored test file (or a documented one).
MIRRORED = PACKAGES
_ELSEWHERE = re.compile(r"^\| `([\w/]+\.py)` \| `(tests/[\w/]+\.py)` \|", re.M)


def test_every_module_has_its_test_file_or_says_where() -> None:
    """``<package>/a/b.py`` is tested in ``tests/<package>/a/test_b.py``, or
    docs/design.md's table names the test that covers it."""
    elsewhere = dict(_ELSEWHERE.findall((ROOT / "docs" / "design.md").read_text()))
    assert len(elsewhere) > 10  # the table was read
    missing, stale = [], []
    for package in MIRRORED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__init__.py" or "_generated" in path.parts:
                continue
            module = str(path.relative_to(ROOT))
            mirror = (
                ROOT / "tests" / path.parent.relative_to(ROOT) / f"test_{path.name.lstrip('_')}"
            )
            if mirror.exists():
                continue
            if module not in elsewhere:
                missing.append(module)
            elif not (ROOT / elsewhere[module]).exists():
                stale.append(f"{module}: {elsewhere[module]}")
    assert missing == [], "modules without a test file or a line in docs/design.md"
    assert stale == [], "docs/design.md names a test file that is not there"
