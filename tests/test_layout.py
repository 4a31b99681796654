"""The layout a reader relies on, read from the source with `ast` (nothing is imported):
rooms layered one way (catalog <- sdtrain <- tasks <- flows), no import cycle among the
project's modules, no module over 600 lines (bench/'s too), no function over 150 lines in the
rooms, and tasks/ in stage-family subpackages only.

Imports at module level and inside functions both count; those under `if TYPE_CHECKING:` do
not (annotations only, never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("catalog", "sdtrain", "tasks", "flows")  # lowest first: a room imports only below it
MAX_LINES = 600
MAX_FUNCTION_LINES = 150


def _modules() -> dict[str, Path]:
    modules = {}
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth, outside `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (i for child in node.orelse for i in _imports_of(child))
            continue
        yield from _imports_of(node)


def _imports_of(node: ast.AST):
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _imports(node)


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules) -> set[str]:
    """The project modules an import statement loads (a submodule, else its package)."""
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        wanted = [f"{base}.{alias.name}" for alias in node.names] + [base]
    found = set()
    for target in wanted:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = set().union(*(_targets(name, path, node, modules) for node in _imports(tree)))
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_over_the_line_limit():
    benchmarks = {f"bench.{p.stem}": p for p in sorted((ROOT / "bench").glob("*.py"))}
    long = {
        name: n
        for name, path in {**_modules(), **benchmarks}.items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"modules over {MAX_LINES} lines: split them by their parts"


def test_no_function_over_the_line_limit():
    long = {
        f"{name}.{node.name}": n
        for name, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    }
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines: split them by their parts"


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


def test_rooms_import_only_below_themselves():
    rank = {room: i for i, room in enumerate(ROOMS)}
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in import_graph().items()
        for target in targets
        if rank[target.split(".")[0]] > rank[name.split(".")[0]]
    )
    assert upward == []


def test_tasks_holds_stage_families_only():
    loose = sorted(p.name for p in (ROOT / "tasks").glob("*.py") if p.name != "__init__.py")
    assert loose == []
    assert all(
        (p / "__init__.py").is_file()
        for p in (ROOT / "tasks").iterdir()
        if p.is_dir() and p.name != "__pycache__"
    )


def test_the_graph_sees_function_level_imports():
    # sdtrain.weights imports sdtrain.finetune inside load_networks only.
    assert "sdtrain.finetune" in import_graph()["sdtrain.weights"]
