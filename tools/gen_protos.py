"""Regenerate specd/v1/*_pb2*.py from protos/ (the only definition of the wire).

Pinned to grpcio-tools 1.85.1 so that regenerating is reproducible; the test
suite regenerates into a temporary folder and fails if the committed code differs.

    python tools/gen_protos.py            # write into the repository
    python tools/gen_protos.py --out DIR  # write elsewhere (used by the test)
"""

import argparse
import importlib.metadata
import pathlib
import sys

from grpc_tools import protoc

PINNED_GRPCIO_TOOLS = "1.85.1"
ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    version = importlib.metadata.version("grpcio-tools")
    if version != PINNED_GRPCIO_TOOLS:
        raise SystemExit(
            f"grpcio-tools {version} is installed; the committed code comes from "
            f"{PINNED_GRPCIO_TOOLS}: pip install grpcio-tools=={PINNED_GRPCIO_TOOLS}"
        )
    protos = sorted(PROTO_ROOT.glob("specd/v1/*.proto"))
    grpc_include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{grpc_include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    # protoc resolves the relative proto paths against the -I roots.
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / "specd" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    out = parser.parse_args().out
    (out / "specd" / "v1").mkdir(parents=True, exist_ok=True)
    for path in generate(out):
        print(path.relative_to(out), file=sys.stderr)


if __name__ == "__main__":
    main()
