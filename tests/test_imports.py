"""The library's modules import one another without cycles (a cycle makes the import order matter and hides
which module a function belongs in), and only downwards, floor by floor (`FLOORS`). Read from the source:
every `import vlmexp...`, at top level, inside a function or under `if TYPE_CHECKING:` (an annotation that
needs a module is a dependency on it too)."""

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
                if node.module == "vlmexp":  # `from vlmexp import answers`: the module answers
                    deps |= {f"vlmexp.{a.name}" for a in node.names}
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
    assert {"vlmexp.checks.loader", "vlmexp.data.sources", "vlmexp.results"} <= graph.keys()
    cycles = _cycles(graph)
    assert not cycles, f"import cycles between library modules: {cycles}"


def _importers(graph: dict[str, set[str]], importer: str, imported: str) -> dict[str, set[str]]:
    """Each module under `importer` with the modules under `imported` it imports."""
    def under(name: str, pkg: str) -> bool:
        return name == pkg or name.startswith(pkg + ".")

    found = {m: {d for d in deps if under(d, imported)} for m, deps in graph.items() if under(m, importer)}
    return {m: deps for m, deps in found.items() if deps}


# The library's floors, ground first. A module imports modules of its own floor or of the floors below it,
# never above: the structure reads bottom-up, and a module's floor says what it may know. A module is placed
# by the longest entry naming it or its package; every module must be placed (a new one: put it on the floor
# of what it is for).
FLOORS = (
    # plain helpers: errors, file writing, a full disk said as such, provenance, answer extraction
    ("vlmexp.errors", "vlmexp.files", "vlmexp.disk", "vlmexp.provenance", "vlmexp.answers"),
    # the model family table, with each family's image budget (Qwen-VL's smart_resize lives in its family)
    ("vlmexp.families",),
    # boxes in each family's frame, detection answers
    ("vlmexp.coords", "vlmexp.detection"),
    # the configuration's ground floor (schema, YAML, TRL arguments, reference) and generic path predicates
    ("vlmexp.config", "vlmexp.paths"),
    # what reads a config or a family: data, rule-based rewards, the tools a model calls (the zoom),
    # processors, launchers (a Ray cluster's checks among them), results
    ("vlmexp.data", "vlmexp.rewards", "vlmexp.tools", "vlmexp.processor", "vlmexp.launch",
     "vlmexp.ray_cluster", "vlmexp.results", "vlmexp.summary"),
    # prompts from records, pictures of boxes and of zooms, tiny models (their tokenizer may learn a tool's
    # block), loading models
    ("vlmexp.prompts", "vlmexp.pictures", "vlmexp.zoom_pictures", "vlmexp.tiny", "vlmexp.modeling"),
    # the one generation engine
    ("vlmexp.generation",),
    # rewards computed by a model (a judge generates through the engine); they build on vlmexp.rewards' base
    ("vlmexp.model_rewards",),
    # a config's reward entry -> a callable: the one registry (REWARDS) joins the rule-based rewards' and the
    # model rewards' from above both, so neither reward package knows the loader
    ("vlmexp.rewards_loader",),
    # loading a config with its checks (reward names, data sources, paths); scoring completions
    ("vlmexp.checks", "vlmexp.scoring"),
    # MLflow tracking, for the pipeline's process and a stage's alike
    ("vlmexp.tracking",),
    # the training stages, and evaluation: siblings (SIBLINGS), each scoring through vlmexp.scoring
    ("vlmexp.train", "vlmexp.evaluate"),
    # what the pipeline's process does: stages' folders and keys, export
    ("vlmexp.pipeline", "vlmexp.export"),
    # the command line, and the driver of a stage on a Ray cluster (it runs the command in each worker)
    ("vlmexp.commands", "vlmexp.cli", "vlmexp.ray_launch"),
)
# Packages of one floor that never import each other.
SIBLINGS = (("vlmexp.train", "vlmexp.evaluate"),)


def _floor(module: str) -> int | None:
    """The floor of a library module (None: placed nowhere); the package's own __init__ (`vlmexp`) is the
    ground."""
    if module == "vlmexp":
        return 0
    placed = [(len(entry), i) for i, floor in enumerate(FLOORS) for entry in floor
              if module == entry or module.startswith(entry + ".")]
    return max(placed)[1] if placed else None


def test_every_import_points_down():
    graph = _graph()
    unplaced = sorted(m for m in graph if _floor(m) is None)
    assert not unplaced, f"modules on no floor: {unplaced}; place each in tests/test_imports.py FLOORS"
    up = {(m, d) for m, deps in graph.items() for d in deps
          if d.startswith("vlmexp") and _floor(d) is not None and _floor(d) > _floor(m)}
    assert not up, f"imports that point up a floor: {sorted(up)}"
    for a, b in SIBLINGS:
        assert not _importers(graph, a, b) and not _importers(graph, b, a), (a, b)
    # rules a past layout broke, read from the floors above
    for lower, upper in (("vlmexp.config", "vlmexp.data"), ("vlmexp.config", "vlmexp.model_rewards"),
                         ("vlmexp.families", "vlmexp.coords"), ("vlmexp.generation", "vlmexp.rewards_loader"),
                         ("vlmexp.model_rewards", "vlmexp.rewards_loader")):
        assert _floor(lower) < _floor(upper), (lower, upper)


def test_layers_point_down():
    """The command line's commands (vlmexp.commands) are the one module that reaches into the orchestration
    (flows/, tasks/, prefect); MLflow tracking serves both the pipeline's process and a stage's and imports
    neither; a training stage never imports the pipeline's process."""
    graph = _graph()
    reach_up = {m: deps for pkg in ("flows", "tasks", "prefect")
                for m, deps in _importers(graph, "vlmexp", pkg).items()}
    assert set(reach_up) <= {"vlmexp.commands"}, reach_up
    assert "vlmexp.commands" in reach_up  # the rule is read from real imports: `vlmexp run` starts the flow


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
