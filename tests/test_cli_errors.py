"""A bad argument to `afd` or any of its subcommands prints one line on stderr and exits 2; only
`--help` prints the usage. Every subcommand is found from the parsers themselves, so a new one is
covered without touching this file."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from afd_engine import flags_doc
from afd_engine.arg_errors import ArgumentParser
from afd_engine.cli import main

AFD = Path(sys.executable).with_name("afd")  # the installed entry point, beside the interpreter
BAD = "--no-such-flag"


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _commands() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command path (`()` is `afd` itself, `("plan", "deploy")` is `afd plan deploy`) -> the
    parser that reads its arguments."""
    from afd_engine.cli import build_parser

    found: dict[tuple[str, ...], argparse.ArgumentParser] = {(): build_parser()}
    todo = [((name,), parser) for name, (parser, _) in flags_doc._real_parsers().items()]
    while todo:
        path, parser = todo.pop()
        found[path] = parser
        sub = _subcommands(parser)
        if sub is not None:
            todo += [((*path, name), p) for name, p in sub.choices.items()]
    return found


COMMANDS = _commands()
PARENTS = sorted(path for path, parser in COMMANDS.items() if _subcommands(parser) is not None)
LEAVES = sorted(path for path, parser in COMMANDS.items() if _subcommands(parser) is None)
CHOICES = [
    pytest.param(
        path, action.option_strings[-1], tuple(action.choices), id=f"{' '.join(path)} {action.option_strings[-1]}"
    )
    for path in LEAVES
    for action in COMMANDS[path]._actions
    if action.choices is not None and action.option_strings
]


def _name(path: tuple[str, ...]) -> str:
    return " ".join(("afd", *path))


def _required(parser: argparse.ArgumentParser) -> list[str]:
    """Arguments that satisfy the parser's required ones (the values only need to parse)."""
    positional, options = [], []
    for action in parser._actions:
        value = str(action.choices[0]) if action.choices else "1"
        if not action.option_strings:
            positional.append(value)
        elif action.required:
            options += [action.option_strings[-1], value]
    return positional + options


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """`afd ARGV` in this process: exit status, stdout, stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str, path: tuple[str, ...]) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, f"{_name(path)}: expected one line on stderr, got:\n{err}"
    assert lines[0].startswith(f"{_name(path)}: error: "), lines[0]
    return lines[0]


def test_every_command_is_found():
    assert {
        "generate",
        "serve",
        "router",
        "launch",
        "demo",
        "expert-load",
        "make-tiny-model",
        "train-tiny",
        "plan deploy",
        "plan model",
        "plan comm",
        "plan sparsity",
        "plan reference",
        "plan calibrate",
        "plan simulate",
    } <= {" ".join(path) for path in LEAVES}
    assert {(), ("plan",)} <= set(PARENTS)


@pytest.mark.parametrize("path", LEAVES, ids=_name)
def test_an_unknown_flag_is_one_line_naming_it(path, capsys):
    code, out, err = _run([*path, *_required(COMMANDS[path]), BAD], capsys)
    line = _one_error_line(err, path)
    assert code == 2 and out == ""
    assert line.endswith(f"unrecognized arguments: {BAD}")


@pytest.mark.parametrize("path", [p for p in LEAVES if any(a.required for a in COMMANDS[p]._actions)], ids=_name)
def test_a_missing_required_argument_is_one_line_naming_it(path, capsys):
    required = [a for a in COMMANDS[path]._actions if a.required]
    code, _, err = _run(list(path), capsys)
    line = _one_error_line(err, path)
    assert code == 2 and "the following arguments are required: " in line
    names = [a.option_strings[-1] if a.option_strings else a.metavar or a.dest for a in required]
    assert all(name in line for name in names), line


@pytest.mark.parametrize(("path", "flag", "choices"), CHOICES)
def test_a_value_outside_the_choices_is_one_line_listing_them(path, flag, choices, capsys):
    code, _, err = _run([*path, *_required(COMMANDS[path]), flag, "not-a-choice"], capsys)
    line = _one_error_line(err, path)
    assert code == 2
    assert f"argument {flag}: invalid choice: 'not-a-choice' (choose from " in line
    assert all(repr(c) in line or str(c) in line for c in choices), line


@pytest.mark.parametrize("path", PARENTS, ids=_name)
def test_a_parent_command_refuses_a_missing_or_unknown_subcommand_in_one_line(path, capsys):
    code, _, err = _run(list(path), capsys)
    assert code == 2 and "the following arguments are required" in _one_error_line(err, path)
    code, _, err = _run([*path, "no-such-command"], capsys)
    line = _one_error_line(err, path)
    assert code == 2 and "invalid choice: 'no-such-command'" in line
    assert all(name in line for name in _subcommands(COMMANDS[path]).choices), line


def test_an_unknown_flag_before_the_subcommand_is_the_top_level_one(capsys):
    code, _, err = _run([BAD, "demo"], capsys)
    assert code == 2 and _one_error_line(err, ()).endswith(f"unrecognized arguments: {BAD}")


def test_a_value_of_the_wrong_type_is_one_line(capsys):
    code, _, err = _run(["serve", "--port", "eighty"], capsys)
    assert code == 2
    assert _one_error_line(err, ("serve",)) == "afd serve: error: argument --port: invalid int value: 'eighty'"


def test_a_multi_line_message_prints_one_line(capsys):
    parser = ArgumentParser(prog="afd x")
    with pytest.raises(SystemExit):
        parser.error("first line\nsecond line")
    assert capsys.readouterr().err == "afd x: error: first line second line\n"


@pytest.mark.parametrize("path", [(), *LEAVES, *PARENTS], ids=_name)
def test_help_still_prints_the_usage(path, capsys):
    code, out, _ = _run([*path, "--help"], capsys)
    assert code == 0 and out.startswith(f"usage: {_name(path)} ")


def test_the_installed_command_prints_one_line():
    res = subprocess.run([AFD, "serve", "--dtype", "float16"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == (
        "afd serve: error: argument --dtype: invalid choice: 'float16' (choose from 'auto', 'float32', 'bfloat16')\n"
    )
