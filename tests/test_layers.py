"""specd's layers, as the tree shows them, and the rule that imports only point down.

    specd.cli                          the `specd` command                      may import anything
    coordinator, draft_service,        the three services
    target_service
    specd.worker                       what the two model workers share
    specd.engine | specd.serving       the model engine (torch) | gRPC plumbing (no torch)
                   specd.observability  tracing and metrics (no torch)
    specd.wire (+ specd.v1)            proto <-> core conversion, generated stubs
    specd.core                         plain types and speculation math

The coordinator serves without the model engine: it never imports torch or transformers.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("specd", "coordinator", "draft_service", "target_service", "benchmarks")

CORE, V1, WIRE, OBSERVABILITY, SERVING, ENGINE, WORKER = (
    "specd.core", "specd.v1", "specd.wire", "specd.observability", "specd.serving", "specd.engine", "specd.worker"
)
BELOW_WORKERS = {CORE, V1, WIRE, OBSERVABILITY, SERVING, ENGINE, WORKER}
# Each layer and what it may import besides itself.
ALLOWED = {
    CORE: set(),
    V1: set(),
    WIRE: {CORE, V1},
    OBSERVABILITY: {CORE},
    SERVING: {CORE, V1, WIRE, OBSERVABILITY},
    ENGINE: {CORE},
    WORKER: {CORE, V1, WIRE, OBSERVABILITY, SERVING, ENGINE},
    "draft_service": BELOW_WORKERS,
    "target_service": BELOW_WORKERS,
    "coordinator": {CORE, V1, WIRE, OBSERVABILITY, SERVING},
    # The top: what nothing below may import.
    "specd.cli": {CORE, V1, WIRE, OBSERVABILITY, SERVING, ENGINE, WORKER, "coordinator", "draft_service", "target_service", "benchmarks"},
    "benchmarks": {CORE, V1, WIRE, OBSERVABILITY, SERVING, ENGINE, WORKER, "coordinator", "draft_service", "target_service", "specd.cli"},
}
# Modules that must load without torch and transformers (the plain types, the wire, the plumbing).
TORCH_FREE = (CORE + ".sampling", CORE + ".outcomes", CORE + ".errors", CORE + ".config", CORE + ".fanout",
              CORE + ".context_match", CORE + ".tokenizer_spec", WIRE, SERVING, OBSERVABILITY, "coordinator")


def layer_of(module: str) -> str | None:
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: pathlib.Path) -> set[str]:
    """Every module `path` imports, anywhere in it (a function-level import counts too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import; write the module's full name"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_imports_point_down():
    known = modules()
    wrong = []
    for name, path in sorted(known.items()):
        layer = layer_of(name)
        if layer is None:
            continue
        for imported in sorted(imports(path)):
            target = layer_of(imported)
            if target is not None and target != layer and target not in ALLOWED[layer] and imported in known:
                wrong.append(f"{name} ({layer}) imports {imported} ({target})")
    assert not wrong, "imports that point the wrong way:\n" + "\n".join(wrong)


def test_core_is_plain_math():
    """The core imports no gRPC and no model library: its math runs wherever its types do."""
    wrong = [
        f"{name} imports {imported}"
        for name, path in sorted(modules().items())
        if layer_of(name) == CORE
        for imported in sorted(imports(path))
        if imported.split(".")[0] in ("grpc", "grpc_health", "transformers", "opentelemetry", "prometheus_client")
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_plain_layers_load_without_torch(module):
    names = [name for name in modules() if name == module or name.startswith(module + ".")]
    code = (
        f"import sys, importlib; [importlib.import_module(m) for m in {names!r}]; "
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); print(heavy); sys.exit(bool(heavy))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{module} imports {run.stdout.strip()}\n{run.stderr[-2000:]}"


# The runtime's shape: a file is one concern and stays short, a function does one thing.
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60
SHAPED = ("specd", "coordinator", "draft_service", "target_service", "benchmarks", "recipes", "tools")


def test_files_and_functions_stay_short():
    too_long = []
    for folder in SHAPED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.parent.name == "v1":  # generated from protos/
                continue
            text = path.read_text()
            where = path.relative_to(ROOT)
            if len(text.splitlines()) > MAX_FILE_LINES:
                too_long.append(f"{where}: {len(text.splitlines())} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        too_long.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "past the limits (a file ~400 lines, a function ~60):\n" + "\n".join(too_long)
