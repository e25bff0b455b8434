"""The library's modules import one another without cycles (a cycle makes the import order matter and hides
which module a function belongs in). Read from the source: every `import vlmexp...`, at top level, inside a
function or under `if TYPE_CHECKING:` (an annotation that needs a module is a dependency on it too)."""

from __future__ import annotations

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "vlmexp"
OURS = ("vlmexp", "flows", "tasks", "prefect")  # the library, the orchestration over it, and Prefect itself


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in LIBRARY.rglob("*.py"):
        name = ".".join(path.relative_to(LIBRARY.parent).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] in OURS}
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
    assert {"vlmexp.config.loader", "vlmexp.data.sources", "vlmexp.results"} <= graph.keys()
    cycles = _cycles(graph)
    assert not cycles, f"import cycles between library modules: {cycles}"


def _importers(graph: dict[str, set[str]], importer: str, imported: str) -> dict[str, set[str]]:
    """Each module under `importer` with the modules under `imported` it imports."""
    def under(name: str, pkg: str) -> bool:
        return name == pkg or name.startswith(pkg + ".")

    found = {m: {d for d in deps if under(d, imported)} for m, deps in graph.items() if under(m, importer)}
    return {m: deps for m, deps in found.items() if deps}


def test_layers_point_down():
    """The command line's commands (vlmexp.commands) are the one module that reaches into the orchestration
    (flows/, tasks/, prefect); MLflow tracking serves both the pipeline's process and a stage's and imports
    neither; a training stage never imports the pipeline's process."""
    graph = _graph()
    reach_up = {m: deps for pkg in ("flows", "tasks", "prefect")
                for m, deps in _importers(graph, "vlmexp", pkg).items()}
    assert set(reach_up) <= {"vlmexp.commands"}, reach_up
    assert "vlmexp.commands" in reach_up  # the rule is read from real imports: `vlmexp run` starts the flow
    for lower, upper in (("vlmexp.tracking", "vlmexp.pipeline"), ("vlmexp.tracking", "vlmexp.train"),
                         ("vlmexp.train", "vlmexp.pipeline"), ("vlmexp.config", "vlmexp.train"),
                         ("vlmexp.config", "vlmexp.pipeline"), ("vlmexp.results", "vlmexp.export")):
        assert not _importers(graph, lower, upper), (lower, upper, _importers(graph, lower, upper))


def test_no_training_stage_imports_another():
    """SFT, DPO and GRPO each own their stage; what they share (generation, data, callbacks, the stage's
    set-up) lives below them."""
    graph = _graph()
    stages = ("vlmexp.train.sft", "vlmexp.train.dpo", "vlmexp.train.grpo")
    for stage in stages:
        others = graph[stage] & (set(stages) - {stage})
        assert not others, (stage, others)


def test_only_the_tracking_package_imports_mlflow():
    """The library, the flows and the tasks reach MLflow through vlmexp.tracking alone (the pipeline's
    tracker, the stage process's run), so one guard decides what an unreachable store costs."""
    root = LIBRARY.parent
    found = {}
    for folder in ("vlmexp", "flows", "tasks"):
        for path in (root / folder).rglob("*.py"):
            if path.is_relative_to(LIBRARY / "tracking"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n == "mlflow" or n.startswith("mlflow.") for n in names):
                    found.setdefault(str(path.relative_to(root)), []).append(node.lineno)
    assert (LIBRARY / "tracking" / "stage_run.py").is_file()
    assert not found, f"modules outside vlmexp/tracking/ that import mlflow: {found}"
