"""The project's modules import each other without a cycle: each can be read and loaded on its own."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("specd", "coordinator", "draft_service", "target_service")


def _module_files() -> dict[str, pathlib.Path]:
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """Project modules `path` imports anywhere in it (a function-level import counts too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in known:
                found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in known)
    return found


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_import_cycle():
    files = _module_files()
    graph = {name: _imports(path, set(files)) - {name} for name, path in files.items()}
    graph = {name: {dep for dep in deps if not name.startswith(dep + ".")} for name, deps in graph.items()}
    cycles = [cycle for name in sorted(graph) if (cycle := _cycle_from(name, graph))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_what_runs_before_a_model_loads_does_not_import_torch():
    """`specd up` checks its flags, and `specd serve ROLE` parses its settings (and prints --help),
    without torch and transformers: importing them takes ~9 s on the 2-core machine."""
    code = (
        "import sys; import specd.cli.up, specd.cli.serve, target_service.config, draft_service.config, coordinator.config; "
        "from specd.engine.model_names import resolve; resolve('.'); "
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); print(heavy); sys.exit(bool(heavy))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
