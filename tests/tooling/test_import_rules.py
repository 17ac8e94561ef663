"""The layering rules, checked on the source: the project's rooms (each folder or module under `serve_app/`, and
`deployments/`) stand on floors, computed from their imports, with no import pointing up (none closes a loop) and
no module importing itself back; `wire/` is the ground floor; Ray is the business of `deployments/`; and the
processes that never run the model (an ingress's HTTP side, a router, a KV-SDK client) never load torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def test_no_module_outside_deployments_imports_ray() -> None:
    importing = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "serve_app").rglob("*.py")
        if any(module == "ray" or module.startswith("ray.") for module in _imported_modules(path))
    }
    assert importing == set()


@pytest.mark.parametrize("module", [
    "serve_app.http.app", "serve_app.kvsdk", "serve_app.routing.decision", "deployments.router", "serve_app.wire.requests",
    "serve_app.wire.calls",
])
def test_importing_a_side_that_runs_no_model_loads_no_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"importing {module} loads torch"


def test_the_wire_types_load_no_ray_either() -> None:
    wire = ", ".join(f"serve_app.wire.{path.stem}" for path in (ROOT / "serve_app" / "wire").glob("[!_]*.py"))
    code = f"import sys, {wire}; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip() == "False"


def _modules() -> dict[str, Path]:
    """Every module of the project, by its dotted name (a package by its own)."""
    found = {}
    for top in ("serve_app", "deployments"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _project_imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project's modules it imports, every import counted (under TYPE_CHECKING, in a function)."""
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    imports: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                names |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
        imports[module] = {found for name in names if (found := resolve(name)) not in (None, module)}
    return imports


def _room(module: str) -> str:
    """The room a module is in: `deployments`, or a folder or module right under `serve_app`."""
    parts = module.split(".")
    return "deployments" if parts[0] == "deployments" else ".".join(parts[:2])


def _loops(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected parts of `graph` with more than one node: its loops (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = set()
            while True:
                member = stack.pop()
                part.add(member)
                if member == node:
                    break
            if len(part) > 1:
                loops.append(part)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in graph:
        if node not in index:
            visit(node)
    return loops


def _floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's floor: 0 for one that imports nothing, else one above the highest it imports (the graph has no
    loops)."""
    floors: dict[str, int] = {}

    def floor(node: str) -> int:
        if node not in floors:
            floors[node] = 1 + max((floor(other) for other in graph[node]), default=-1)
        return floors[node]

    for node in graph:
        floor(node)
    return floors


def _arrows(imports: dict[str, set[str]], rooms: Iterable[str]) -> list[str]:
    wanted = set(rooms)
    return sorted(
        f"{module} -> {target}" for module, targets in imports.items() for target in targets
        if _room(module) in wanted and _room(target) in wanted and _room(module) != _room(target)
    )


def test_the_rooms_stand_on_floors_and_no_import_points_up() -> None:
    imports = _project_imports(_modules())
    rooms: dict[str, set[str]] = {}
    for module, targets in imports.items():
        rooms.setdefault(_room(module), set()).update(_room(t) for t in targets if _room(t) != _room(module))
    loops = _loops(rooms)
    assert loops == [], "imports that point up (each loop's arrows):\n" + "\n".join(
        arrow for loop in loops for arrow in _arrows(imports, loop)
    )
    floors = _floors(rooms)
    assert floors["serve_app.wire"] == 0 and rooms["serve_app.wire"] == set()  # the wire imports nothing of ours
    assert floors["serve_app.config"] == 1 and floors["deployments"] > floors["serve_app.http"] > floors["serve_app.engine"]


def test_no_module_imports_itself_back() -> None:
    assert _loops(_project_imports(_modules())) == []
