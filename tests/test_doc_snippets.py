"""Every Python snippet of the README and ``docs/`` either runs here or says what the
reader supplies.

- A block right after the line ``<!-- snippet: runs -->`` is run as written (as a
  ``__main__`` module, in a directory where ``runs/scored`` is a recording of the tiny
  vLLM teacher), with the names its ``# You supply:`` line lists (if any) provided by
  :data:`SUPPLIED`.
- Every other block has a ``# You supply: NAME, NAME (what it is), ...`` comment line,
  and every name it uses without defining or importing it is listed there.

Adding a runnable snippet: put the marker before it; if it needs a name no snippet has
needed yet, add a maker for it to ``SUPPLIED``.
"""

from __future__ import annotations

import ast
import builtins
import re
import shutil
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNS_MARKER = "<!-- snippet: runs -->"
SUPPLY = re.compile(r"^\s*# You supply: (.*)$", re.M)
RECORDING = ROOT / "tests" / "data" / "tiny_vllm_recording"  # the tiny model, K 64


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int
    code: str
    runs: bool

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def supplied(self) -> set[str]:
        """The names its ``# You supply:`` line lists (descriptions in parentheses
        dropped)."""
        names: set[str] = set()
        for listed in SUPPLY.findall(self.code):
            without = listed
            while re.search(r"\([^()]*\)", without):  # nested parentheses: innermost first
                without = re.sub(r"\([^()]*\)", "", without)
            names.update(re.findall(r"\b([A-Za-z_]\w*)\b(?:\s*(?:,|$|and\b))", without))
        return names


def snippets() -> list[Snippet]:
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                before = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
                code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
                out.append(Snippet(path, i + 1, code, before == RUNS_MARKER))
                i = end
            i += 1
    return out


def free_names(code: str) -> set[str]:
    """Names the code reads but never binds (assigns, imports, defines, takes as an
    argument) anywhere, builtins excepted."""
    tree = ast.parse(code)
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound - set(dir(builtins)) - {"__name__"}


SNIPPETS = snippets()


def test_snippets_are_found() -> None:
    assert len(SNIPPETS) >= 20 and any(s.runs for s in SNIPPETS)


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if not s.runs], ids=lambda s: s.name)
def test_an_excerpt_names_what_the_reader_supplies(snippet: Snippet) -> None:
    missing = free_names(snippet.code) - snippet.supplied()
    assert SUPPLY.search(snippet.code), (
        f"{snippet.name}: neither runs ({RUNS_MARKER} before it) nor says what the "
        f"reader supplies (a '# You supply: ...' line); it uses {sorted(missing)}"
    )
    assert not missing, f"{snippet.name}: uses {sorted(missing)}, not in its '# You supply:'"


def _tiny_student(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


#: What a runnable snippet's "# You supply:" names are, here: ``name -> maker(context)``.
SUPPLIED: dict[str, Callable[[dict[str, Any]], Any]] = {
    "student": lambda ctx: ctx.setdefault("student", _tiny_student(ctx["tiny_model_dir"])),
    "opt": lambda ctx: __import__("torch").optim.SGD(
        ctx["student"].parameters(), lr=ctx.setdefault("lr", 0.1)
    ),
}


@pytest.mark.filterwarnings("ignore:recording runs/scored.*without checksums")
@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.runs], ids=lambda s: s.name)
def test_a_runnable_snippet_runs(
    snippet: Snippet,
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shutil.copytree(RECORDING, tmp_path / "runs" / "scored")
    monkeypatch.chdir(tmp_path)
    context: dict[str, Any] = {"tiny_model_dir": tiny_model_dir}
    names = sorted(snippet.supplied(), key=lambda n: list(SUPPLIED).index(n))
    namespace: dict[str, Any] = {"__name__": "__main__"}
    namespace.update({name: SUPPLIED[name](context) for name in names})
    assert free_names(snippet.code) <= set(names), snippet.name
    exec(compile(snippet.code, snippet.name, "exec"), namespace)
    if "student" in names:  # it trained: every parameter of the student got a gradient
        params = list(namespace["student"].parameters())
        assert all(p.grad is not None for p in params if p.requires_grad), snippet.name
