"""The Python standard library the draft recipe writes its prompts from, split in two: files
are assigned to the held-out side by the sha1 of their relative path, so a held-out file never
lends a prompt to training. Everything is rebuilt offline from the stdlib this interpreter ships
(or another interpreter's, given its folder).
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import sysconfig
from pathlib import Path

EXCLUDED_DIRS = {"test", "tests", "idle_test", "lib2to3", "site-packages", "__pycache__", "idlelib", "turtledemo"}


def stdlib_root(explicit: Path | None = None) -> Path:
    """`explicit` if given (another interpreter's stdlib, to rebuild that data), else this interpreter's."""
    return explicit if explicit is not None else Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """Relative paths (posix, sorted) of the stdlib's *.py files, tests and demos left out."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                found.append((Path(dirpath) / name).relative_to(root).as_posix())
    return sorted(found)


def is_heldout(relative_path: str, percent: int) -> bool:
    digest = int.from_bytes(hashlib.sha1(relative_path.encode()).digest()[:8], "big")
    return digest % 100 < percent


def read_split(heldout_percent: int, heldout: bool, root: Path | None = None) -> dict[str, str]:
    """{relative path: source} for one side of the split of the stdlib at `root` (default: this interpreter's)."""
    root = stdlib_root(root)
    sources = {}
    for rel in stdlib_files(root):
        if is_heldout(rel, heldout_percent) != heldout:
            continue
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            sources[rel] = text
    return sources


# A line and its ending as ast counts lines: "\r\n", "\r" or "\n" end one (str.splitlines would
# also split at form feeds and other separators, and miscount ast's line numbers).
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def source_segment(lines: list[str], node: ast.AST) -> str:
    """ast.get_source_segment(source, node) for `lines` = _LINE.findall(source), split once per
    file: get_source_segment splits the whole source again for every node, which made reading
    the stdlib's definitions take 40 s."""
    first, last = node.lineno - 1, node.end_lineno - 1
    # Column offsets count UTF-8 bytes.
    if first == last:
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset :].decode()
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return "".join([head, *lines[first + 1 : last], tail])


def documented_definitions(module: str, source: str) -> list[dict]:
    """Top-level and method definitions that have a docstring: name, signature, doc, source."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = _LINE.findall(source)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.name.startswith("_"):
            continue
        segment = source_segment(lines, node)
        if isinstance(node, ast.ClassDef):
            signature = node.name
        else:
            signature = f"{node.name}({ast.unparse(node.args)})"
        found.append(
            {
                "module": module,
                "name": node.name,
                "kind": "class" if isinstance(node, ast.ClassDef) else "function",
                "signature": signature,
                "summary": doc.strip().split("\n\n")[0].replace("\n", " ")[:300],
                "source": "\n".join(segment.splitlines()[:40]),
            }
        )
    return found


def module_name(relative_path: str) -> str:
    return relative_path[: -len(".py")].replace("/", ".").removesuffix(".__init__")


def all_definitions(sources: dict[str, str]) -> list[dict]:
    return [d for rel in sorted(sources) for d in documented_definitions(module_name(rel), sources[rel])]
