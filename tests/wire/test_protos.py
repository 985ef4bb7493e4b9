"""The committed generated code (specd/v1/) is exactly what tools/gen_protos.py makes from protos/."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATED_PATTERNS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def _generated(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for pattern in GENERATED_PATTERNS for p in sorted(folder.glob(pattern))}


def test_generated_code_matches_the_protos(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
        timeout=120,
    )
    fresh = _generated(tmp_path / "specd" / "v1")
    committed = _generated(ROOT / "specd" / "v1")
    protos = sorted(p.stem for p in (ROOT / "protos" / "specd" / "v1").glob("*.proto"))
    assert protos, "no .proto sources found"
    expected_names = sorted(f"{stem}{suffix}" for stem in protos for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))
    assert sorted(fresh) == expected_names
    missing = sorted(set(fresh) - set(committed))
    extra = sorted(set(committed) - set(fresh))
    assert not missing, f"generated files not committed under specd/v1: {missing}; run tools/gen_protos.py"
    assert not extra, f"specd/v1 holds generated files no .proto makes: {extra}"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"specd/v1 differs from protos/ in {stale}: run tools/gen_protos.py and commit"
