"""Settings as frozen dataclasses, filled once from flags, then env vars, then defaults.

Each field of a service's config dataclass becomes a flag `--field-name` and an
env var `SPECD_FIELD_NAME`; a flag beats the env var, which beats the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, TypeVar

ENV_PREFIX = "SPECD_"

C = TypeVar("C")


class ConfigError(ValueError):
    """A setting has a value that cannot work; the message says what to change."""


def setting(default: Any, help: str, choices: tuple | None = None) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


def _converter(kind: Any):
    if kind is bool:
        return _parse_bool
    if kind in (int, float, str):
        return kind
    raise TypeError(f"unsupported setting type {kind!r}")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of `cls`; defaults come from the env or the dataclass."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        convert = _converter(hints[field.name])
        env = env_name(field.name)
        default = field.default
        if env in os.environ:
            try:
                default = convert(os.environ[env])
            except ValueError as exc:
                raise ConfigError(f"{env}={os.environ[env]!r}: {exc}") from None
        help_text = f"{field.metadata.get('help', '')} (env {env}; default {default!r})"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %: a literal % must not break --help
        if hints[field.name] is bool:
            parser.add_argument(
                flag_name(field.name),
                dest=field.name,
                default=default,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag_name(field.name),
                dest=field.name,
                default=default,
                type=convert,
                choices=field.metadata.get("choices"),
                help=help_text,
            )


def from_namespace(cls: type[C], namespace: argparse.Namespace) -> C:
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)}
    config = cls(**values)
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config
