"""`specd serve target|draft|coordinator`: run one service until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from specd.cli.parent_death import stop_with_parent
from specd.core.config import ConfigError, add_arguments, from_namespace
from specd.serving.cpus import pin_process

ROLES = {
    "target": ("target_service.config", "TargetConfig", "target_service.server"),
    "draft": ("draft_service.config", "DraftConfig", "draft_service.server"),
    "coordinator": ("coordinator.config", "CoordinatorConfig", "coordinator.server"),
}


def _config_class(role: str):
    import importlib

    module_name, class_name, _ = ROLES[role]
    return getattr(importlib.import_module(module_name), class_name)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="run the target worker, the draft worker or the coordinator")
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role in ROLES:
        role_parser = roles.add_parser(role, help=f"run the {role}")
        add_arguments(role_parser, _config_class(role))
        role_parser.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                                 help="logging level (default: %(default)s)")
        role_parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import importlib

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = from_namespace(_config_class(args.role), args)
    except ConfigError as exc:
        print(f"specd serve {args.role}: {exc}", file=sys.stderr)
        return 2
    stop_with_parent()  # started by `specd up`: end with it, however it ends
    pin_process(config.cpus)  # before the server starts its threads; they inherit it
    server_module = importlib.import_module(ROLES[args.role][2])
    try:
        asyncio.run(server_module.serve(config))
    except ConfigError as exc:
        print(f"specd serve {args.role}: {exc}", file=sys.stderr)
        return 2
    except (OSError, TimeoutError) as exc:
        print(f"specd serve {args.role}: {exc}", file=sys.stderr)
        return 1
    return 0
