"""The package's layout holds: roles as subpackages on floors, every import pointing down a
floor or across one, no cycles (type-only imports included), few modules at the top."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "trainrun"

# Low to high: a module may import its own floor and the floors below it (docs/internals.md).
FLOORS = [
    ("trainrun.errors", "trainrun.extras"),
    ("trainrun.config",),
    ("trainrun.platform",),
    # the storage layer: models' weights and data are read from object storage through it too
    ("trainrun.storage",),
    ("trainrun.models", "trainrun.data"),
    ("trainrun.rundir",),
    ("trainrun.reporting",),
    ("trainrun.program",),
    # the fast paths: strategies the plain path's seams in program/ and training/ take
    ("trainrun.fast",),
    ("trainrun.checkpointing",),
    ("trainrun.training",),
    # what was trained, loaded, scored and generated from
    ("trainrun.evaluation",),
    ("trainrun", "trainrun.cli", "trainrun.export", "trainrun.verify_resume", "trainrun.__main__"),
]
MAX_TOP_LEVEL_MODULES = 8


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def floor(module: str) -> int:
    best, found = -1, None
    for index, names in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), index
    assert found is not None, f"{module} is on no floor: add it to FLOORS"
    return found


def imports(module: str) -> set[str]:
    """The trainrun modules ``module`` imports anywhere in its file (in functions and under
    ``TYPE_CHECKING`` too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "trainrun"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.split(".")[0] != "trainrun":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return {name for name in found if name != module and name in MODULES}


GRAPH = {module: imports(module) for module in MODULES}


def test_every_import_points_down_a_floor_or_across_one():
    upward = [f"{m} (floor {floor(m)}) imports {i} (floor {floor(i)})"
              for m, targets in sorted(GRAPH.items()) for i in sorted(targets)
              if floor(i) > floor(m)]
    assert upward == []


def test_the_programs_import_nothing_from_reporting():
    """program/ is pure and jittable: what it sends out (a streamed row, a compile's time) goes
    to an object handed in, so no program module reaches reporting/, directly or through
    another module."""

    def reached(module: str, seen: set[str]) -> set[str]:
        for target in GRAPH[module] - seen:
            seen.add(target)
            reached(target, seen)
        return seen

    found = [f"{m} reaches {r}" for m in sorted(GRAPH) if m.startswith("trainrun.program")
             for r in sorted(reached(m, set())) if r.startswith("trainrun.reporting")]
    assert found == []


def test_the_run_directory_front_only_re_exports():
    """rundir/__init__.py names what the package holds and defines nothing: its logic lives in
    modules named for what they are, which import each other and never the front (the front
    imports them all)."""
    front = ast.parse(MODULES["trainrun.rundir"].read_text())
    defined = [type(node).__name__ for node in front.body
               if not isinstance(node, ast.Import | ast.ImportFrom | ast.Expr)
               and not (isinstance(node, ast.Assign)
                        and [ast.unparse(x) for x in node.targets] == ["__all__"])]
    assert defined == []
    inside = [m for m in sorted(GRAPH) if m.startswith("trainrun.rundir.")
              and "trainrun.rundir" in GRAPH[m]]
    assert inside == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles():
    """No module imports round in a circle, type-only imports included."""
    assert _cycles(GRAPH) == []


def package(module: str) -> str:
    """The subpackage a module belongs to (``trainrun.rundir``), or the module itself at the
    top."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or MODULES[module].name == "__init__.py" else (
        module)


def test_no_package_import_cycles():
    """No subpackage imports another that imports it back, through any chain of modules."""
    packages: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        packages.setdefault(package(module), set()).update(
            package(t) for t in targets if package(t) != package(module))
    for targets in list(packages.values()):
        for target in targets:
            packages.setdefault(target, set())
    assert _cycles(packages) == []


def test_the_top_level_holds_the_commands_and_the_facade_only():
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    for name in top:
        assert floor(module_name(SRC / name)) in (0, len(FLOORS) - 1), name


def test_the_floor_test_sees_an_upward_import():
    """The checks above would fail on a lower floor importing a higher one."""
    assert floor("trainrun.program.step") < floor("trainrun.training.loop")
    assert "trainrun.program.state" in GRAPH["trainrun.program.step"]
