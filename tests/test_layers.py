"""The import graph of the product code keeps its layers one-way (issue 15).

    entry points   tasks/cli.py, tasks/__main__.py, flows/
    stages         tasks/{ingest,reward,train,evaluate,deploy}/   (never import one another)
    online side    serving/                                         (imports no stage)
    libraries      tasks/*.py            (import no stage, and nothing of serving/ but the store)

Every import counts, the lazy ones inside functions too: a circle through a lazy import is still a
circle a reader has to untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tasks", "serving", "flows")
STAGES = ("ingest", "reward", "train", "evaluate", "deploy")
ENTRY_POINTS = {"tasks.cli", "tasks.__main__"}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports (resolved to the longest existing module name)."""
    files = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                candidates = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            for candidate in candidates:
                while candidate and candidate not in files:
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != name and candidate.split(".")[0] in PACKAGES:
                    targets.add(candidate)
        graph[name] = targets
    return graph


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "tasks" and parts[1] in STAGES else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for src, targets in sorted(graph.items()):
        if src in ENTRY_POINTS or src.startswith("flows"):
            continue
        for dst in sorted(targets):
            if dst in ENTRY_POINTS or dst.startswith("flows"):
                found.append(f"{src} -> {dst}: imports an entry point")
            elif _stage(src) and _stage(dst) and _stage(src) != _stage(dst):
                found.append(f"{src} -> {dst}: a stage imports another stage")
            elif src.startswith("serving") and _stage(dst):
                found.append(f"{src} -> {dst}: serving imports a stage")
            elif src.startswith("tasks") and dst.startswith("serving") and dst != "serving.store":
                found.append(f"{src} -> {dst}: tasks import serving beyond the store")
            elif src.startswith("tasks") and not _stage(src) and _stage(dst):
                found.append(f"{src} -> {dst}: a library module imports a stage")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary circle's node set, found once (Tarjan's strongly connected components > 1)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_the_product_imports_have_no_circle():
    assert cycles(import_graph()) == []


def test_imports_only_go_down_the_layers():
    assert layer_violations(import_graph()) == []


def test_the_checks_catch_a_circle_and_an_upward_import():
    graph = {
        "tasks.a": {"tasks.b"},
        "tasks.b": {"tasks.a"},
        "serving.gateway": {"tasks.reward.reward"},
        "tasks.train.ppo": {"tasks.evaluate.gate", "serving.store"},
        "tasks.fim": {"tasks.cli"},
    }
    assert cycles(graph) == [["tasks.a", "tasks.b"]]
    assert layer_violations(graph) == [
        "serving.gateway -> tasks.reward.reward: serving imports a stage",
        "tasks.fim -> tasks.cli: imports an entry point",
        "tasks.train.ppo -> tasks.evaluate.gate: a stage imports another stage",
    ]
