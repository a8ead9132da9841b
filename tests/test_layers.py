"""The package's layers, read from the source: imports point one way, no loops, no imports hidden in functions."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rules", "cost_model", "runtime", "partitioner")

# Lowest first: a module may import modules of its own layer or of layers listed before it.
# Within one layer, modules import one another freely but without loops (checked separately).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("rules",),
    ("cost_model",),
    ("runtime",),
    ("partitioner.errors",),
    ("partitioner.request",),
    ("partitioner.capture",),
    ("partitioner.predict",),
    ("partitioner.place",),
    ("partitioner.make",),
    ("partitioner.calibrate",),
    ("partitioner.export",),
    ("partitioner.show",),
    ("partitioner.arguments", "partitioner.api", "partitioner.meta", "partitioner.pippy_policy"),
    ("partitioner.cli",),
    ("partitioner", "partitioner.__main__"),
)
# runtime/ and cost_model/ are siblings: neither imports the other (nor anything above them).
SIBLINGS = {"cost_model": "runtime", "runtime": "cost_model"}
MAX_LINES = 400
# Inside partitioner/place/: the search layer both searches stand on, the two searches (siblings: neither imports
# the other), and the planners above them (planning.py and replicated.py decide which search runs).
PLACE_ROOMS = ("partitioner.place.search", ("partitioner.place.devices", "partitioner.place.cluster"))
PLACE_DEPTH = 8  # files on the longest chain of place/ modules importing each other


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an import names (`a.b.c` may name the function c of module a.b)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> list[tuple[str, bool, int]]:
    """(module imported, inside a function, line) for every import of a project module in `path`."""
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names = [child.module] + [f"{child.module}.{alias.name}" for alias in child.names]
            for name in names:
                target = _resolve(name)
                if target is not None:
                    found.append((target, in_function, child.lineno))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return list(dict.fromkeys(found))


def _layer(module: str) -> int:
    best = -1
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if module == prefix or (module.startswith(prefix + ".") and prefix != "partitioner"):
                best = index
    if best < 0:
        raise AssertionError(f"{module} is in no layer of tests/test_layers.py: add its package to LAYERS")
    return best


def _graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module, path in MODULES.items():
        for target, _, _ in _imports(path):
            if target != module and not module.startswith(target + "."):  # a package's own __init__ is not a loop
                graph.add_edge(module, target)
    return graph


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        _layer(module)


def test_imports_point_down_the_layers() -> None:
    upward = []
    for module, path in MODULES.items():
        mine = _layer(module)
        top = module.split(".")[0]
        for target, _, line in _imports(path):
            theirs = _layer(target)
            if theirs > mine or SIBLINGS.get(top) == target.split(".")[0]:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target} (layer {theirs} > {mine})")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_loops_between_files() -> None:
    cycles = sorted(" -> ".join(c) for c in nx.simple_cycles(_graph()))
    assert not cycles, "import loops:\n" + "\n".join(cycles)


def test_no_project_imports_inside_functions() -> None:
    hidden = [f"{path.relative_to(ROOT)}:{line} imports {target} inside a function"
              for module, path in MODULES.items() for target, inside, line in _imports(path) if inside]
    assert not hidden, "imports of the project's own modules belong at the top of the file:\n" + "\n".join(hidden)


@pytest.mark.parametrize("package", ["partitioner"])
def test_modules_stay_short(package: str) -> None:
    long = {str(p.relative_to(ROOT)): n for m, p in MODULES.items() if m.split(".")[0] == package
            for n in [len(p.read_text(encoding="utf-8").splitlines())] if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (one concept per module): {long}"


def test_the_checker_sees_a_loop_and_an_upward_import(tmp_path: Path) -> None:
    """The walk itself can fail: a hand-made upward import and a hidden import are found."""
    source = tmp_path / "m.py"
    source.write_text("import os\nfrom partitioner.api import plan\n\ndef f():\n    from runtime.plan import Plan\n")
    found = _imports(source)
    assert ("partitioner.api", False, 2) in found and ("runtime.plan", True, 5) in found
    assert _layer("partitioner.api") > _layer("partitioner.place.planning") > _layer("runtime.plan")
    rooms = [_place_room(f"partitioner.place.{m}") for m in ("search.space", "devices.dp", "cluster.plan", "planning")]
    assert rooms == [0, 1, 1, 2]


def _place_room(module: str) -> int:
    """0: place/search/, 1: place/devices/ or place/cluster/, 2: the rest of place/ (the planners above them)."""
    search, searches = PLACE_ROOMS
    if module == search or module.startswith(search + "."):
        return 0
    return 1 if any(module == s or module.startswith(s + ".") for s in searches) else 2


def test_the_two_searches_stand_on_the_search_layer_alone() -> None:
    """place/devices/ and place/cluster/ never import each other; place/search/ imports neither, nor anything above."""
    wrong = []
    place = {m: p for m, p in MODULES.items() if m.startswith("partitioner.place.")}
    for module, path in place.items():
        for target, _, line in _imports(path):
            if not target.startswith("partitioner.place."):
                continue
            mine, theirs = _place_room(module), _place_room(target)
            other_search = mine == theirs == 1 and target.split(".")[2] != module.split(".")[2]
            if theirs > mine or other_search:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "imports across the two searches or back up place/:\n" + "\n".join(wrong)


def test_place_is_shallow() -> None:
    graph = _graph().subgraph(m for m in MODULES if m.startswith("partitioner.place"))
    chain = nx.dag_longest_path(graph)
    assert len(chain) <= PLACE_DEPTH, (f"place/ is {len(chain)} files deep (at most {PLACE_DEPTH}): "
                                       + " -> ".join(chain))

