"""The `specd` command: serve, up, generate, bench, trace, health."""

from __future__ import annotations

import argparse
import gc
import importlib
import sys

# Subcommand -> module with add_parser(subparsers) and run(args) -> int; imported lazily
# so that `specd generate` does not pay for importing torch.
COMMANDS = {
    "serve": "specd.cli.serve",
    "up": "specd.cli.up",
    "generate": "specd.cli.generate",
    "bench": "specd.cli.bench",
    "trace": "specd.cli.trace",
    "health": "specd.cli.health",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="speculative speculative decoding over gRPC")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    for name, module_name in COMMANDS.items():
        if wanted is None or name == wanted:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name != module_name:
                    raise
                continue  # a subcommand not built yet
            module.add_parser(subparsers)
        else:
            subparsers.add_parser(name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from specd.core.config import ConfigError

    try:
        parser = build_parser(argv)  # flags' defaults come from SPECD_* variables, checked here
    except ConfigError as exc:
        print(f"specd: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ConfigError as exc:  # a setting that cannot work (an unreadable TLS file, ...): no traceback
        print(f"specd {args.command}: {exc}", file=sys.stderr)
        return 2


def run_program() -> None:
    """The `specd` program: main(), then exit. Not main() itself, which tests call in-process.

    The garbage is frozen first: an interpreter that imported torch and transformers spends
    ~2.4 s of CPU at exit collecting their objects (0.35 s frozen; measured on the 2-core
    machine), which made stopping a `specd up` stack take 7.7 s. Exit handlers still run:
    logs and spans are flushed as before.
    """
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run_program()
