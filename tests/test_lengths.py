"""Files and functions that do one job (issue 41 item 6): no product file over 400 lines, no function over 60.

Product files are the Python modules under `tasks/`, `serving/` and `flows/`, and the benchmarks under `bench/`
(issue 55: they make the headline numbers). A file counts every line; a
function counts the lines from its `def` (decorators not included) to its last line, nested functions with it.

The one exception is declared, never inferred: a function may run longer when a comment starting `# long:`
stands on its `def` line or on the line just above it (between the decorators and the `def` is fine), and says
why in the same line, e.g. `# long: one flat sequence of steps, each a call; split, it would read worse`.
Use it for a function that is a flat sequence better read whole, not to skip a split that would help.
A file has no such exception: over 400 lines, split it.

Run as `python tests/test_lengths.py` to print every file and function over the limits (marked or not).

Known debt is named in `DVC_DEBT` and `BENCH_DEBT` and nowhere else. `BENCH_DEBT`: the benchmarks over the limits
when bench/ came under them (bench/learning.py was split then; these are owed). `DVC_DEBT` (empty now:
`tasks/sim/editor.py` and `tasks/train/base.py:pretrain`, code deps of the DVC stages `fim` and `base`, were split
with the stages' outputs proven unchanged, old and new builds compared, and `dvc commit`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.support.tree import source_files

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tasks", "serving", "flows", "bench")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
MARKER = "# long:"


def product_files() -> list[Path]:
    return source_files(ROOT, PACKAGES)


def file_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def functions(path: Path) -> Iterator[tuple[str, int, int, bool]]:
    """(qualified name, def line, length in lines, marked `# long:`) for every function in the file."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines), filename=str(path))

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                around = lines[child.lineno - 2 : child.lineno] if child.lineno > 1 else lines[:1]
                yield name, child.lineno, length, any(MARKER in line for line in around)
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")

    yield from walk(tree, "")


def long_files() -> list[tuple[str, int]]:
    found = [(p.relative_to(ROOT).as_posix(), file_lines(p)) for p in product_files()]
    return sorted(((name, n) for name, n in found if n > MAX_FILE_LINES), key=lambda item: -item[1])


def long_functions() -> list[tuple[str, int, bool]]:
    found = [
        (f"{p.relative_to(ROOT).as_posix()}:{line} {name}", length, marked)
        for p in product_files()
        for name, line, length, marked in functions(p)
        if length > MAX_FUNCTION_LINES
    ]
    return sorted(found, key=lambda item: -item[1])


# Known debt, named one by one (see the module doc); an entry that is no longer over the limit fails, so it goes.
DVC_DEBT: set[str] = set()
BENCH_DEBT: set[str] = {
    "bench/gpu/ppo_bench.py",
    "bench/gpu/ppo_bench.py run_one",
    "bench/adapters.py main",
    "bench/base_size.py main",
    "bench/cancel_bias.py main",
    "bench/gateway_profile.py main",
    "bench/headroom.py main",
    "bench/ingest.py main",
    "bench/kl_probe.py main",
    "bench/matched_rule.py report",
    "bench/mlflow_screenshot.py screenshot",
    "bench/stop_rule.py main",
}
DEBT = DVC_DEBT | BENCH_DEBT


def test_no_product_file_is_over_the_limit() -> None:
    over = [(name, n) for name, n in long_files() if name not in DEBT]
    assert not over, f"product files over {MAX_FILE_LINES} lines (split them by job): {over}"


def test_no_function_is_over_the_limit_unless_marked() -> None:
    over = [(name, n) for name, n, marked in long_functions() if not marked and _key(name) not in DEBT]
    assert not over, (
        f"functions over {MAX_FUNCTION_LINES} lines without a `{MARKER} why` comment on or above the def: {over}"
    )


def test_the_known_debt_is_still_owed() -> None:
    owed = {name for name, _ in long_files()} | {_key(name) for name, _, marked in long_functions() if not marked}
    paid = DEBT - owed
    assert not paid, f"no longer over the limit: remove {sorted(paid)} from DVC_DEBT or BENCH_DEBT"


def _key(located: str) -> str:
    """`path:line name` -> `path name` (line numbers move; the debt names the function)."""
    where, name = located.split(" ", 1)
    return f"{where.split(':')[0]} {name}"


if __name__ == "__main__":
    print(f"files over {MAX_FILE_LINES} lines:")
    for name, n in long_files():
        print(f"  {n:5d}  {name}")
    print(f"functions over {MAX_FUNCTION_LINES} lines ({MARKER} = marked, allowed):")
    for name, n, marked in long_functions():
        print(f"  {n:5d}  {name}{'  ' + MARKER if marked else ''}")
