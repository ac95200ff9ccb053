"""The structure holds: imports point one way between the rooms of the code, no modules import
each other in a loop, and no function is over 80 lines."""

import ast
from pathlib import Path

import composer_dag

REPO = Path(composer_dag.__file__).resolve().parent.parent

FLOORS = {
    "composer_dag.storage": 0,
    "composer_dag.catalog": 1, "composer_dag.runtime": 1, "composer_dag.pipes": 1,
    "composer_dag.corpus": 2, "composer_dag.cluster": 2, "composer_dag.sandbox": 2, "composer_dag.tasks": 2,
    "composer_dag.train": 2,
    "resources": 3, "composer_dag.dedup": 3, "composer_dag.inference": 3, "composer_dag.laptop": 3,
    "composer_dag.repos": 3,
    "composer_dag.grading": 4, "composer_dag.gateway": 4,
    "composer_dag.harness": 5, "composer_dag.tasks.sources": 5,
    "composer_dag.agent": 6,
    "composer_dag.evals": 7, "composer_dag.rl": 7, "composer_dag.traces": 7,
    "composer_dag.cli": 8, "composer_dag.sft": 8,
    "assets": 9,
    "composer_dag.definitions": 10,
}
"""The rooms of the code, lowest floor first (the README's layout section): a room imports rooms
on its own floor or below, never one above, and no rooms import each other in a loop."""


def _room(module: str) -> str | None:
    """The room a module belongs to: the longest name in ``FLOORS`` that it is or lies under
    (``composer_dag.tasks.sources`` is a room of its own above ``composer_dag.tasks``)."""
    parts = module.split(".")
    if parts[0] in ("assets", "resources"):
        return parts[0]
    if parts[0] != "composer_dag" or len(parts) == 1:
        return None
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in FLOORS:
            return ".".join(parts[:n])
    return ".".join(parts[:2])


def _arrows() -> dict[tuple[str, str], list[str]]:
    """(room, imported room) -> the files with such an import (lazy imports inside functions too)."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for top in ("composer_dag", "assets", "resources"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO)
            module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
            src = _room(module)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        up = package.split(".")[: len(package.split(".")) - node.level + 1]
                        base = ".".join(up + ([base] if base else []))
                    targets = [base] + [f"{base}.{a.name}" for a in node.names] if base == "composer_dag" else [base]
                else:
                    continue
                for t in targets:
                    dst = _room(t)
                    if src and dst and dst != src:
                        arrows.setdefault((src, dst), []).append(str(rel))
    return arrows


def _find_loop(graph: dict[str, set[str]]) -> list[str] | None:
    """One loop of ``graph`` (a -> ... -> a), or None: a depth-first search for an edge back into
    the path it is on."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                loop = path + [node, nxt]
                return loop[loop.index(nxt):]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_imports_point_one_way():
    arrows = _arrows()
    rooms = {r for pair in arrows for r in pair}
    assert rooms <= set(FLOORS), f"rooms without a floor: {sorted(rooms - set(FLOORS))}"
    upward = {f"{a} -> {b}": sorted(set(files)) for (a, b), files in arrows.items() if FLOORS[b] > FLOORS[a]}
    assert not upward, f"imports that point up: {upward}"
    graph: dict[str, set[str]] = {}
    for a, b in arrows:
        graph.setdefault(a, set()).add(b)
    loop = _find_loop(graph)
    assert loop is None, f"rooms that import each other: {' -> '.join(loop)}"


def test_module_imports_have_no_cycle():
    """Within a room too: no two modules import each other, directly or around a loop (module-level
    imports; a lazy import inside a function is how a loop would hide, so those count as well)."""
    edges: dict[str, set[str]] = {}
    names = set()
    for top in ("composer_dag", "assets", "resources"):
        for path in sorted((REPO / top).rglob("*.py")):
            names.add(".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"))
    for top in ("composer_dag", "assets", "resources"):
        for path in sorted((REPO / top).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        up = package.split(".")[: len(package.split(".")) - node.level + 1]
                        base = ".".join(up + ([base] if base else []))
                    cands = [f"{base}.{a.name}" for a in node.names] + [base]
                elif isinstance(node, ast.Import):
                    cands = [a.name for a in node.names]
                else:
                    continue
                for c in cands:
                    if c in names and c != module and not module.startswith(c + ".") and not c.endswith("__init__"):
                        if (REPO / c.replace(".", "/")).is_dir():
                            continue   # a package's __init__ hands names on
                        edges.setdefault(module, set()).add(c)
    loop = _find_loop(edges)
    assert loop is None, f"modules that import each other: {' -> '.join(loop)}"


LONG_FUNCTIONS_ALLOWED = {
    "composer_dag/grading/check_runner.py:_main":
        "the sandboxed test runner keeps its per-run key in one closure's cells, where no code under test "
        "can reach it through a module global; splitting it into functions would hand the key around",
}


def test_no_function_is_over_80_lines():
    long = {}
    for top in ("composer_dag", "assets", "resources"):
        for path in sorted((REPO / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    where = f"{path.relative_to(REPO)}:{node.name}"
                    if n > 80 and where not in LONG_FUNCTIONS_ALLOWED:
                        long[where] = n
    assert not long, f"functions over 80 lines: {long}"


def test_no_private_name_is_imported_across_packages():
    """A package's private names (``_x``) stay inside it: an import from another room names only
    public names, so a package's inside can change without its users knowing."""
    found = {}
    for top in ("composer_dag", "assets", "resources"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO)
            module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if _room(base) in (None, _room(module)):
                    continue
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private or any(p.startswith("_") and not p.startswith("__") for p in base.split(".")):
                    found.setdefault(f"{rel}:{node.lineno}", []).extend(private or [base])
    assert not found, f"private names imported from another package: {found}"
