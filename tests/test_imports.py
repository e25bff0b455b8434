"""The library's modules import one another without cycles (a cycle makes the import order matter and hides
which module a function belongs in). Read from the source: every `import vlmexp...`, at top level, inside a
function or under `if TYPE_CHECKING:` (an annotation that needs a module is a dependency on it too)."""

from __future__ import annotations

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "vlmexp"


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in LIBRARY.rglob("*.py"):
        name = ".".join(path.relative_to(LIBRARY.parent).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlmexp"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("vlmexp")}
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v] & graph.keys():
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_library_has_no_import_cycle():
    graph = _graph()
    assert {"vlmexp.config_loader", "vlmexp.data.sources", "vlmexp.results"} <= graph.keys()
    cycles = _cycles(graph)
    assert not cycles, f"import cycles between library modules: {cycles}"
