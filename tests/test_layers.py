"""The product's imports point down three floors (issue 41), with no whitelist.

    flows/      top      the flows, the demo driver, the root CLI (flows/cli/, one module per noun)
    serving/    middle   the gateway; imports only the core and the simulated users
    tasks/      bottom   stages   tasks/{ingest,reward,train,evaluate,deploy}/  (never import one another)
                         sim      tasks/sim/   the corpus, the simulated editor and users, held-out acceptance
                         core     tasks/core/  config, FIM, schema, outcomes, the log store, generation, processes

A module may import its own floor and the floors below it, never one above. Every import counts,
the lazy ones inside functions and under ``TYPE_CHECKING`` too, and no two modules import each
other through any chain (a circle through a lazy import is still a circle a reader has to untangle).
Beside the product: tests/ and bench/ may import any of it, and bench/ may import tests/support/, but
no test imports bench/ (what both need lives in tests/support/ or the product), and no bench patches
``sys.path`` (benches run as ``python -m bench.NAME`` from the repo root).
Each failure prints its file, line and the rule it breaks.

Which serving backend runs is the serving engine's business (tasks/core/engines/, issue 55): no module outside
the engines and the config compares a ``.backend``, ``.adapter_serving`` or ``.adapter_engine`` with a string
(``==``, ``!=``, ``in``, or a ``match``); it asks the engine instead.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from tests.support.tree import source_files

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tasks", "serving", "flows")
STAGES = ("ingest", "reward", "train", "evaluate", "deploy")
# Lowest first. A package's own __init__ (tasks, tasks.core, ...) sits on the floor of what it holds.
FLOORS = ("core", "sim", "stage", "serving", "flows")


@dataclass(frozen=True)
class Import:
    src: str
    dst: str
    where: str  # path:line, for the message


def _module(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(candidate: str, known: set[str]) -> str | None:
    while candidate and candidate not in known:
        candidate = candidate.rpartition(".")[0]
    return candidate or None


def imports(root: Path = ROOT) -> list[Import]:
    """Every import of one product module by another, module-level or lazy, with where it is written."""
    files = {_module(p, root): p for p in source_files(root, PACKAGES)}
    known = set(files)
    found = []
    for name, path in sorted(files.items()):
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from .x import y
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                candidates = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            for dst in {_resolve(c, known) for c in candidates} - {None, name}:
                found.append(Import(name, str(dst), where))
    return found


def floor(module: str) -> str | None:
    """The floor a module lives on, or None for a module that is on no floor (a misplaced file)."""
    parts = module.split(".")
    if parts[0] in ("flows", "serving"):
        return parts[0]
    if parts[0] != "tasks":
        return None
    if len(parts) == 1 or parts[1] == "core":
        return "core"
    if parts[1] == "sim":
        return "sim"
    if parts[1] in STAGES:
        return "stage"
    return None


def violations(found: list[Import]) -> list[str]:
    """One line per import that breaks a floor rule, saying where and why."""
    lines = []
    for name in sorted({i.src for i in found} | {i.dst for i in found}):
        if floor(name) is None:
            lines.append(f"{name}: on no floor (tasks/ holds core/, sim/ and the stages {', '.join(STAGES)})")
    for i in sorted(found, key=lambda i: (i.where, i.dst)):
        src, dst = floor(i.src), floor(i.dst)
        if src is None or dst is None:
            continue
        if FLOORS.index(dst) > FLOORS.index(src):
            lines.append(f"{i.where}: {i.src} ({src}) imports {i.dst} ({dst}), a floor above it")
        elif src == dst == "stage" and i.src.split(".")[1] != i.dst.split(".")[1]:
            lines.append(f"{i.where}: {i.src} imports {i.dst}: a stage imports another stage")
        elif src == "serving" and dst == "stage":
            lines.append(f"{i.where}: {i.src} imports {i.dst}: serving imports only the core and the simulated users")
    return lines


def circles(found: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for i in found:
        graph.setdefault(i.src, set()).add(i.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
    return sorted(components)


def breaks_between_tests_and_benches(root: Path = ROOT) -> list[str]:
    """Each test import of bench/ and each bench touching sys.path, as file:line and what it does."""
    lines = []
    for folder, rule in (("tests", "a test imports bench/"), ("bench", "a bench patches sys.path")):
        for path in source_files(root, (folder,)):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if folder == "tests" and isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module or ""]
                elif folder == "tests" and isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif folder == "bench" and isinstance(node, ast.Attribute) and node.attr == "path":
                    names = ["sys.path"] if isinstance(node.value, ast.Name) and node.value.id == "sys" else []
                else:
                    continue
                if any(n == "sys.path" or n.split(".")[0] == "bench" for n in names):
                    lines.append(f"{path.relative_to(root)}:{node.lineno}: {rule}")
    return lines


BRANCH_ATTRS = ("backend", "adapter_serving", "adapter_engine")  # what only the engines may branch on
ENGINE_MODULES = ("tasks/core/engines/", "tasks/core/config/")


def _branch_attr(node: ast.expr) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) and node.attr in BRANCH_ATTRS else None


def _strings(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(_strings(e) for e in node.elts)


def backend_branches(root: Path = ROOT) -> list[str]:
    """Each comparison of a backend setting with a string outside the engine modules, as file:line: what."""
    lines = []
    for path in source_files(root, PACKAGES):
        where = path.relative_to(root).as_posix()
        if where.startswith(ENGINE_MODULES):
            continue
        found: list[tuple[int, str]] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                attrs = [a for a in map(_branch_attr, sides) if a]
                if attrs and any(_strings(side) for side in sides):
                    found.append((node.lineno, f"compares .{attrs[0]} with a string"))
            elif isinstance(node, ast.Match) and (attr := _branch_attr(node.subject)):
                found.append((node.lineno, f"matches .{attr}"))
        lines += [f"{where}:{line}: {what}: ask the engine" for line, what in sorted(found)]
    return lines


def _report(title: str, lines: list[str]) -> str:
    return f"{len(lines)} {title}:\n  " + "\n  ".join(lines)


def test_imports_only_point_down_the_floors():
    found = violations(imports())
    assert not found, _report("imports break the floors", found)


def test_no_two_modules_import_each_other_through_any_chain():
    found = [" <-> ".join(c) for c in circles(imports())]
    assert not found, _report("import circles", found)


def test_no_test_imports_a_bench_and_no_bench_patches_sys_path():
    found = breaks_between_tests_and_benches()
    assert not found, _report("breaks between tests/ and bench/", found)


def test_only_the_engines_branch_on_the_serving_backend():
    found = backend_branches()
    assert not found, _report("branches on the serving backend outside tasks/core/engines", found)


def test_the_backend_check_catches_each_kind_of_branch(tmp_path):
    for folder in ("tasks/core/engines", "tasks/deploy", "serving", "flows"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "tasks/deploy/a.py").write_text(
        "def f(p, arm):\n"
        "    if p.serving.backend == 'vllm':\n"
        "        pass\n"
        "    ok = arm.backend in ('embedded', 'vllm')\n"
        "    same = arm.backend == other.backend\n"  # two settings, no string: not a branch on a name
        "    match p.serving.adapter_serving:\n"
        "        case 'lora':\n"
        "            pass\n"
    )
    (tmp_path / "serving/b.py").write_text("x = 'merged' != params.evaluate.adapter_engine\n")
    (tmp_path / "tasks/core/engines/vllm.py").write_text("y = params.serving.adapter_serving == 'lora'\n")
    assert backend_branches(tmp_path) == [
        "serving/b.py:1: compares .adapter_engine with a string: ask the engine",
        "tasks/deploy/a.py:2: compares .backend with a string: ask the engine",
        "tasks/deploy/a.py:4: compares .backend with a string: ask the engine",
        "tasks/deploy/a.py:6: matches .adapter_serving: ask the engine",
    ]


def test_the_apart_check_catches_a_bench_import_and_a_path_patch(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("import os\n\n\ndef f():\n    from bench.harness import run\n")
    (tmp_path / "bench" / "b.py").write_text("import sys\n\nsys.path.insert(0, '.')\n")
    assert breaks_between_tests_and_benches(tmp_path) == [
        "tests/test_x.py:5: a test imports bench/",
        "bench/b.py:3: a bench patches sys.path",
    ]


def test_the_checks_catch_each_kind_of_break():
    def imp(src: str, dst: str) -> Import:
        return Import(src, dst, f"{src.replace('.', '/')}.py:1")

    found = [
        imp("tasks.core.a", "tasks.core.b"),
        imp("tasks.core.b", "tasks.core.a"),
        imp("tasks.core.fim", "tasks.sim.editor"),
        imp("tasks.sim.editor", "tasks.core.fim"),
        imp("tasks.train.ppo", "tasks.evaluate.gate"),
        imp("tasks.train.ppo", "tasks.train.loss"),
        imp("serving.gateway", "tasks.reward.reward"),
        imp("serving.gateway", "tasks.sim.editor"),
        imp("tasks.ingest.pull", "serving.log"),
        imp("serving.log", "flows.cli"),
        imp("flows.cli", "tasks.deploy.ab"),
        imp("tasks.helpers", "tasks.core.fim"),
    ]
    assert circles(found) == [["tasks.core.a", "tasks.core.b"], ["tasks.core.fim", "tasks.sim.editor"]]
    assert violations(found) == [
        "tasks.helpers: on no floor (tasks/ holds core/, sim/ and the stages ingest, reward, train, evaluate, deploy)",
        "serving/gateway.py:1: serving.gateway imports tasks.reward.reward: serving imports only the core and the "
        "simulated users",
        "serving/log.py:1: serving.log (serving) imports flows.cli (flows), a floor above it",
        "tasks/core/fim.py:1: tasks.core.fim (core) imports tasks.sim.editor (sim), a floor above it",
        "tasks/ingest/pull.py:1: tasks.ingest.pull (stage) imports serving.log (serving), a floor above it",
        "tasks/train/ppo.py:1: tasks.train.ppo imports tasks.evaluate.gate: a stage imports another stage",
    ]
