"""The layering rules, checked on the source: Ray is the business of `deployments/`, and the processes that
never run the model (an ingress's HTTP side, a router, a KV-SDK client) never load torch."""

from __future__ import annotations

import ast
import subprocess
import sys
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
    "serve_app.http.app", "serve_app.kvsdk", "serve_app.routing.decision", "deployments.router", "serve_app.engine.io",
])
def test_importing_a_side_that_runs_no_model_loads_no_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"importing {module} loads torch"


def test_the_wire_types_load_no_ray_either() -> None:
    code = "import sys, serve_app.engine.io; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip() == "False"
