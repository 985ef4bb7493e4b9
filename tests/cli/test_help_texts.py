"""Every flag of every `specd` subcommand says in --help what it does and what happens without it."""

from __future__ import annotations

import argparse

import pytest

from specd.cli import COMMANDS, build_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _leaf_parsers(command: str) -> dict[str, argparse.ArgumentParser]:
    """`specd COMMAND`'s parser, or for serve one per ROLE, by their command lines."""
    parser = _subparsers(build_parser([command]))[command]
    nested = _subparsers(parser)
    if nested:
        return {f"{command} {name}": sub for name, sub in nested.items()}
    return {command: parser}


def _pure_switch(action: argparse.Action) -> bool:
    """A flag that only turns something on; off, its default, goes without saying."""
    return isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_says_what_it_does_and_its_default(command):
    parsers = _leaf_parsers(command)
    assert parsers
    for line, parser in parsers.items():
        options = _options(parser)
        assert options, f"specd {line} has no options: its module did not load"
        parser.format_help()  # a help text argparse cannot format (a stray %) fails here
        for action in options:
            name = f"specd {line} {'/'.join(action.option_strings)}"
            assert action.help and action.help is not argparse.SUPPRESS and action.help.strip(), f"{name}: no help"
            if not _pure_switch(action):
                assert "default" in action.help or "(env" in action.help, f"{name}: help names no default: {action.help!r}"
        for action in parser._actions:
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
                assert action.help and action.help.strip(), f"specd {line} {action.dest}: no help"


def test_generate_sampling_flags_say_where_their_values_come_from():
    parser = _leaf_parsers("generate")["generate"]
    helps = {a.option_strings[0]: a.help for a in _options(parser)}
    for flag in ("--temperature", "--top-k", "--top-p", "--repetition-penalty"):
        assert "the target checkpoint's generation defaults" in helps[flag], flag
    assert "--default-max-new-tokens" in helps["--max-new-tokens"]
    assert "picks one" in helps["--seed"]


def test_help_shows_numeric_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser(["up"]).parse_args(["up", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 600.0)" in text  # --startup-timeout, through %(default)s
    assert "(default: 50051)" in text  # --port
