"""docs/configuration.md is generated from the `afd` parsers and must match what they define now."""

from __future__ import annotations

import os
import re
from dataclasses import fields

import pytest

from afd_engine import flags_doc
from afd_engine.cli import build_parser
from afd_engine.engine_args import EngineArgs

PAGE = flags_doc.PAGE


@pytest.fixture(scope="module")
def page() -> str:
    assert PAGE.is_file(), f"{PAGE} is missing: run `{flags_doc.COMMAND}`"
    return PAGE.read_text()


@pytest.fixture(scope="module")
def generated() -> str:
    return flags_doc.render()


def test_page_is_current(page, generated):
    if page != generated:
        diff = flags_doc.check(PAGE)
        shown = "\n".join(diff[:60])
        pytest.fail(f"{PAGE} is stale: run `{flags_doc.COMMAND}` and commit the result.\n{shown}", pytrace=False)


def _row(page: str, flag: str) -> list[str]:
    """The cells of the first table row of `flag` (its engine or server table, where the flag is in one)."""
    for line in page.splitlines():
        if line.startswith(f"| `{flag}` |"):
            return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
    raise AssertionError(f"{flag} has no row in {PAGE}")


@pytest.mark.parametrize(
    "flag, kind, default, words",
    [
        ("--port", "int", "`30000`", "HTTP port"),
        ("--mode", "one of `single`, `colocated`, `afd`", "`single`", "separate ranks"),
        ("--micro-batches", "int", "unset", "default: 3 for afd, 1 otherwise"),
        ("--comm-timeout", "float", "`30.0`", "seconds a rank waits for a peer"),
        ("--dist-init-addr", "string", "required", "rendezvous"),
        ("--enable-eplb", "switch", "off", "rebalance expert placement"),
        ("--api-key", "string, repeatable", "unset", "bearer token"),
    ],
)
def test_known_flags(page, flag, kind, default, words):
    cells = _row(page, flag)
    assert cells[1:3] == [kind, default], cells
    assert words in cells[3], cells


def test_sections_and_anchors(page):
    for heading in ("# Configuration reference", "## afd serve", "## afd launch", "## YAML configuration files"):
        assert f"\n{heading}\n" in page, heading
    assert flags_doc.COMMAND in page.splitlines()[0], "the first line must say how the page is generated"
    for name in ("serve", "launch"):
        section = page.split(f"\n## afd {name}\n", 1)[1].split("\n## ", 1)[0]
        assert "[server flags](#server-flags)" in section and "[engine flags](#engine-flags)" in section


def _command_line(command: str) -> list[str]:
    required = {"generate": ["--prompt", "x"], "launch": ["--role", "ffn", "--dist-init-addr", "127.0.0.1:1"]}
    return [command, *required.get(command, [])]


@pytest.mark.parametrize("command", ["generate", "serve", "launch", "demo"])
def test_yaml_keys_are_those_apply_config_accepts(page, command):
    """The keys the page lists are what afd_engine.deploy_config.apply_config allows: the engine
    settings and the command's parsed names, less `command` and `config`."""
    ns = build_parser().parse_args(_command_line(command))
    allowed = {f.name for f in fields(EngineArgs)} | (set(vars(ns)) - {"command", "config"})
    parser = flags_doc._real_parsers()[command][0]
    assert set(flags_doc._yaml_keys(parser)) == allowed
    yaml_section = page.split("\n## YAML configuration files\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in yaml_section.splitlines() if line.startswith("| ") and f"`afd {command}`" in line]
    listed = {key for row in rows for key in re.findall(r"`([a-z0-9_]+)`", row.rsplit("|", 2)[0])}
    assert listed == allowed


def test_page_does_not_depend_on_the_machine(generated, monkeypatch):
    monkeypatch.setenv("COLUMNS", "37")
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert flags_doc.render() == generated


def test_check_reports_a_stale_page(tmp_path, generated, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(generated.replace("| `--port` | int | `30000` |", "| `--port` | int | `8080` |"))
    assert flags_doc.main(["--check", "--page", str(stale)]) == 1
    err = capsys.readouterr().err
    assert "`8080`" in err and flags_doc.COMMAND in err
    stale.write_text(generated)
    assert flags_doc.main(["--check", "--page", str(stale)]) == 0
