"""Regenerate docs/configuration.md from the services' config dataclasses (the only definition of the settings).

Every field of CoordinatorConfig, TargetConfig and DraftConfig is one row: its flag, env var,
default and meaning (the field's `setting(default, help)`); a default the target device's
profile fills in lists the profiles' values (coordinator/profiles.py). The test suite renders
the page into a temporary file and fails if the committed one differs. Imports no torch.

    python tools/gen_config_docs.py            # write docs/configuration.md
    python tools/gen_config_docs.py --check    # exit 1 if docs/configuration.md differs
    python tools/gen_config_docs.py --out FILE # write elsewhere (used by the test)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import pathlib
import sys
import typing

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
sys.path.insert(0, str(ROOT))  # this checkout's modules, not an installed copy's

from coordinator.profiles import PROFILES
from specd.cli.serve import ROLES
from specd.cli.supervise import PLAINTEXT_STACK_DROPS
from specd.core.config import ENV_PREFIX, env_name, flag_name

TITLES = {
    "coordinator": "Coordinator",
    "target": "Target worker",
    "draft": "Draft worker",
}
ORDER = ("coordinator", "target", "draft")  # then any other role, in ROLES' order

INTRO = """\
Each service reads its settings once, when it starts. Every setting is a flag `--field-name` and
an env var `SPECD_FIELD_NAME`: a flag given on the command line beats the env var, which beats the
default listed here. A boolean setting is switched with `--name` / `--no-name`, and its env var
takes `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`). `specd serve ROLE --help` shows the same
settings with the defaults the current environment gives them.

`specd up` starts the three services with its own environment, so a `SPECD_*` variable set for it
reaches every service that has that setting (`SPECD_MAX_SUPPORT`, for one, sets both the
coordinator's and the draft's). Two exceptions: the settings `specd up` gives each service as flags
(listed under each table; they beat the environment), and the TLS variables, which its plaintext
local stack drops:
{drops}.
To serve TLS, start each service with `specd serve`.
"""


def role_config(role: str) -> type:
    module_name, class_name, _ = ROLES[role]
    return getattr(importlib.import_module(module_name), class_name)


def from_profile(role: str, field: dataclasses.Field) -> bool:
    """Whether the target device's profile fills in `field` of `role` when it is left at its default
    (coordinator/config.py: PROFILE_SETTINGS, FROM_PROFILE, profile_overrides)."""
    module = importlib.import_module(ROLES[role][0])
    sentinels = (getattr(module, "FROM_PROFILE", None), "")
    return field.name in getattr(module, "PROFILE_SETTINGS", ()) and field.default in sentinels


def relative(value):
    """A default path inside this checkout, as a path relative to it (the page is the same on every machine)."""
    if isinstance(value, str) and os.path.isabs(value):
        with contextlib.suppress(ValueError):
            return pathlib.Path(value).relative_to(ROOT).as_posix()
    return value


def literal(value) -> str:
    value = relative(value)
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if value == "":
        return "empty"
    return f"`{value}`"


def cell(text: str) -> str:
    """Text that stays one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def default_cell(field: dataclasses.Field, from_profile: bool) -> str:
    if not from_profile:
        return literal(field.default)
    values = ", ".join(f"{name} {literal(getattr(profile, field.name))}" for name, profile in PROFILES.items())
    return f"{literal(field.default)}: *the device profile's* ({values})"


def flag_cell(field: dataclasses.Field, kind) -> str:
    flag = flag_name(field.name)
    if kind is bool:
        return f"`{flag}` / `--no-{flag[2:]}`"
    return f"`{flag}`"


def meaning_cell(field: dataclasses.Field) -> str:
    text = field.metadata.get("help", "")
    choices = field.metadata.get("choices")
    if choices:
        text += "; one of " + ", ".join(literal(choice) for choice in choices)
    return cell(text)


@contextlib.contextmanager
def without_specd_env():
    """No SPECD_* variables while a parser is built: the page's defaults are the code's, not this shell's."""
    saved = {name: value for name, value in os.environ.items() if name.startswith(ENV_PREFIX)}
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(saved)


def other_options(role: str, config: type) -> list[argparse.Action]:
    """`specd serve ROLE`'s options that are not settings of its config class (--log-level)."""
    from specd.cli import serve

    commands = argparse.ArgumentParser().add_subparsers()
    with without_specd_env():
        serve.add_parser(commands)
    roles = next(a for a in commands.choices["serve"]._actions if isinstance(a, argparse._SubParsersAction))
    role_parser = roles.choices[role]
    names = {f.name for f in dataclasses.fields(config)}
    return [
        action for action in role_parser._actions
        if action.option_strings and action.dest not in names and action.dest != "help"
    ]


def up_flags() -> dict[str, list[str]]:
    """The flags `specd up` gives each service (before --cpus, which it adds where it pins CPUs)."""
    from specd.cli import up

    args = argparse.Namespace(
        host="127.0.0.1", threads=1, device="auto", dtype="float32", target=up.DEFAULT_TARGET,
        draft=up.DEFAULT_DRAFT, target_tensor_parallel=1, pin_cpus=False,
    )
    ports = {name: 1 for name in ("coordinator", "target", "draft")}
    ports.update({f"metrics-{name}": 1 for name in ("coordinator", "target", "draft")})
    services = up.build_services(args, ports, pathlib.Path("logs"))
    return {s.name: [arg for arg in s.argv[1:] if arg.startswith("--")] for s in services}


def section(role: str, passed_by_up: list[str]) -> list[str]:
    config = role_config(role)
    hints = typing.get_type_hints(config)
    lines = [
        f"## {TITLES.get(role, role.capitalize())}: `specd serve {role}`",
        "",
        f"From `{config.__module__}.{config.__name__}`.",
        "",
        "| Flag | Env var | Default | Meaning |",
        "| --- | --- | --- | --- |",
    ]
    for field in dataclasses.fields(config):
        lines.append(
            f"| {flag_cell(field, hints[field.name])} | `{env_name(field.name)}` "
            f"| {default_cell(field, from_profile(role, field))} "
            f"| {meaning_cell(field)} |"
        )
    for action in other_options(role, config):
        default = literal(action.default) if action.default is not None else "none"
        help_text = (action.help or "").split(" (default")[0]
        if action.choices:
            help_text += "; one of " + ", ".join(literal(choice) for choice in action.choices)
        lines.append(f"| `{action.option_strings[-1]}` | (none) | {default} | {cell(help_text)} |")
    lines.append("")
    if passed_by_up:
        given = ", ".join(f"`{flag}`" for flag in passed_by_up)
        note = (f"Under `specd up`, set by its own flags whatever the environment says: {given}, "
                "and `--cpus` where it pins CPUs (`--pin-cpus`).")
        lines += [note, ""]
    return lines


def render() -> str:
    drops = ", ".join(f"`{name}`" for name in PLAINTEXT_STACK_DROPS)
    lines = [
        "# Configuration",
        "",
        "<!-- Generated by tools/gen_config_docs.py from the config dataclasses: edit those, then run",
        "     `python tools/gen_config_docs.py`. A test fails when this page is stale. -->",
        "",
        INTRO.format(drops=drops).rstrip(),
        "",
        "A default that reads *the device profile's* is filled in from the profile of the device the target",
        "worker runs on (`coordinator/profiles.py`, whose values each table lists); a flag or env var set to",
        "another value overrides it.",
        "",
    ]
    passed = up_flags()
    roles = [r for r in ORDER if r in ROLES] + [r for r in ROLES if r not in ORDER]
    for role in roles:
        lines += section(role, passed.get(role, []))
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DOC, help="file to write (default: docs/configuration.md)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if --out differs from what would be written (default: off)")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        try:
            current = args.out.read_text()
        except FileNotFoundError:
            current = None
        if current != text:
            print(f"{args.out} is stale: run python tools/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(args.out, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
