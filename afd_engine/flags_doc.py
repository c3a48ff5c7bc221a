"""The flags reference page, docs/configuration.md, generated from the `afd` command's own parsers.

    python -m afd_engine.flags_doc            # print the page
    python -m afd_engine.flags_doc --write    # write docs/configuration.md
    python -m afd_engine.flags_doc --check    # exit 1, saying what differs, when the page is stale

Every flag, type, choice, default and help text comes from the argparse parsers that `afd` builds
(afd_engine/cli.py, which takes the engine flags from EngineArgs and the server flags from
ServerArgs); the YAML keys are computed the way afd_engine/deploy_config.py accepts them. The page
holds nothing that depends on the machine it is generated on.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import fields
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGE = REPO_ROOT / "docs" / "configuration.md"
COMMAND = "python -m afd_engine.flags_doc --write"
# the `afd` subcommands with a section of their own; the others go under "Other commands"
MAIN_COMMANDS = ("serve", "launch")
_TYPE_NAMES = {None: "string", str: "string", int: "int", float: "float"}


# -- reading the parsers ---------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """name -> (its parser, its one-line help), in the order the parser lists them."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    return {name: (p, helps.get(name, "")) for name, p in sub.choices.items()}


def _real_parsers() -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """Every `afd` subcommand's parser: the stubs of `afd make-tiny-model`, `afd train-tiny` and
    `afd plan` (which hand their arguments to parsers of their own) replaced by those parsers."""
    from afd_engine.cli import build_parser
    from afd_engine.planner.cli import build_parser as build_plan_parser
    from afd_engine.tiny_model import build_make_tiny_model_parser
    from afd_engine.train_tiny import build_train_tiny_parser

    commands = _subcommands(build_parser())
    own = {
        "make-tiny-model": build_make_tiny_model_parser(),
        "train-tiny": build_train_tiny_parser(),
        "plan": build_plan_parser(),
    }
    return {name: (own.get(name, parser), help_) for name, (parser, help_) in commands.items()}


def _flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


# -- one flag as a table row -----------------------------------------------------------------------


def _escape(text: str) -> str:
    """Markdown for a table cell: backtick spans kept, outside them the characters Markdown or HTML
    would take for syntax escaped."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code spans at all
        parts = [text.replace("`", "\\`")]
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append("`" + part.replace("|", "\\|") + "`")
            continue
        for char, escaped in (("\\", "\\\\"), ("|", "\\|"), ("*", "\\*"), ("<", "&lt;"), (">", "&gt;")):
            part = part.replace(char, escaped)
        out.append(part)
    return " ".join("".join(out).split())


def _help_text(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion (%(default)s, %%)
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        params["prog"] = parser.prog
        if params.get("choices") is not None:
            params["choices"] = ", ".join(map(str, params["choices"]))
        text = text % params
    return text


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "switch"
    if isinstance(action, argparse._StoreFalseAction):
        return "switch (turns off)"
    if action.choices is not None:
        kind = "one of " + ", ".join(f"`{c}`" for c in action.choices)
    else:
        kind = _TYPE_NAMES.get(action.type, getattr(action.type, "__name__", str(action.type)))
    if action.nargs == "+":
        kind += ", one or more"
    elif action.nargs == "*":
        kind += ", any number"
    elif isinstance(action.nargs, int) and action.nargs > 1:
        kind += f", {action.nargs} values"
    if isinstance(action, argparse._AppendAction):
        kind += ", repeatable"
    return kind


def _default(action: argparse.Action) -> str:
    if action.required or (not action.option_strings and action.nargs not in ("?", "*")):
        return "required"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off"
    value = action.default
    if value is None or value == [] or value is argparse.SUPPRESS:
        return "unset"
    if value == "":
        return '`""`'
    if isinstance(value, (list, tuple)):
        return ", ".join(f"`{v}`" for v in value)
    return f"`{value}`"


def _row(action: argparse.Action, parser: argparse.ArgumentParser) -> tuple[str, str, str, str]:
    names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest.upper()}`"
    text = _escape(_help_text(action, parser))
    for group in parser._mutually_exclusive_groups:
        others = [o for a in group._group_actions if a is not action for o in a.option_strings[:1]]
        if action in group._group_actions and others:
            if text and not text.endswith("."):
                text += "."
            text = (text + " " if text else "") + "Not together with " + ", ".join(f"`{o}`" for o in others) + "."
    return names, _kind(action), _default(action), text


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| Flag | Type | Default | Description |", "| --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


# -- the page --------------------------------------------------------------------------------------


def _sentence(text: str) -> str:
    text = text.strip()
    if not text:
        return ""
    text = text[0].upper() + text[1:]
    return _escape(text if text.endswith(".") else text + ".")


def _anchor(name: str) -> str:
    """The MkDocs anchor of a heading `afd NAME` (lower case, spaces to hyphens)."""
    return "afd-" + name.replace(" ", "-")


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


class _Shared:
    """A block of flags several commands take alike (the engine flags, the server flags): printed
    once, in its own section, and referred to from each command that has all of it unchanged."""

    def __init__(self, title: str, anchor: str, names: set[str], source: str) -> None:
        self.title, self.anchor, self.names, self.source = title, anchor, names, source
        self.rows: list[tuple[str, str, str, str]] | None = None
        self.commands: list[str] = []

    def take(self, command: str, parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> list:
        """The actions of `parser` this block covers (removed from `actions`), when it covers all of
        them exactly as its first command has them; else nothing (they stay the command's own)."""
        mine = [a for a in actions if a.dest in self.names]
        if {a.dest for a in mine} != self.names:
            return []
        rows = [_row(a, parser) for a in mine]
        if self.rows is None:
            self.rows = rows
        if rows != self.rows:
            return []
        self.commands.append(command)
        return mine

    def link(self) -> str:
        return f"[{self.title.lower()}](#{self.anchor})"


def _yaml_keys(parser: argparse.ArgumentParser) -> list[str]:
    """The keys `--config` accepts for this command (afd_engine.deploy_config.accepted_keys)."""
    from afd_engine.deploy_config import accepted_keys

    return accepted_keys(a.dest for a in parser._actions if a.default is not argparse.SUPPRESS)


def render() -> str:
    from afd_engine.engine_args import EngineArgs
    from afd_engine.server.serve import ServerArgs

    commands = _real_parsers()
    engine_names = {f.name for f in fields(EngineArgs)}
    server = _Shared("Server flags", "server-flags", {f.name for f in fields(ServerArgs)}, "ServerArgs")
    engine = _Shared("Engine flags", "engine-flags", engine_names, "EngineArgs")

    # each command: its own flags (rows) and the shared blocks it takes
    sections: dict[str, tuple[list, list[_Shared]]] = {}
    for name, (parser, _) in commands.items():
        actions = _flag_actions(parser)
        shared = []
        for block in (server, engine):
            taken = block.take(name, parser, actions)
            if taken:
                actions = [a for a in actions if a not in taken]
                shared.append(block)
        sections[name] = ([_row(a, parser) for a in actions], shared)

    out = [
        f"<!-- Generated by `{COMMAND}` from the argument parsers; do not edit this file by hand. -->",
        "",
        "# Configuration reference",
        "",
        f"This page is generated from the code by `{COMMAND}`; edit the parsers, not the page.",
        "It lists every flag of the `afd` command with its type, default and help text, as the argument",
        "parsers define them (`afd_engine/cli.py`). Engine flags are the fields of `EngineArgs`",
        "(`afd_engine/engine_args.py`) and server flags the fields of `ServerArgs`",
        "(`afd_engine/server/serve.py`). A flag's name is the field's name with underscores turned into",
        "dashes: `--kv-cache-memory-mb 512` on the command line is `EngineArgs(kv_cache_memory_mb=512)` in",
        "Python (see [API](api.md)) and `kv-cache-memory-mb: 512` in a",
        "[configuration file](#yaml-configuration-files). `afd COMMAND --help` prints the same flags.",
        "",
        "A default of *unset* means that the flag has no value unless it is given; its description says",
        "what the engine does then. A value of the wrong type or outside the choices is refused before",
        "anything starts, and the engine then checks ranges and combinations of flags",
        "(`EngineArgs.validate`); either way the command names the flag and exits with status 2.",
        "",
        "| Command | What it does |",
        "| --- | --- |",
    ]
    for name, (_, help_) in commands.items():
        out.append(f"| [afd {name}](#{_anchor(name)}) | {_sentence(help_)} |")
    out.append("")

    def command_section(name: str, level: str) -> None:
        parser, help_ = commands[name]
        own, shared = sections[name]
        out.extend([f"{level} afd {name}", "", _sentence(help_), ""])
        if own:
            if shared:
                out.extend(["Its own flags:", ""])
            out.extend(_table(own))
        if shared:
            also = _and([f"the {block.link()}" for block in shared])
            out.extend([f"{'It also takes' if own else 'It takes'} {also}.", ""])
        for sub_name, (sub, sub_help) in _subcommands(parser).items() if parser._subparsers else []:
            out.extend([f"{level}# afd {name} {sub_name}", "", _sentence(sub_help), ""])
            out.extend(_table([_row(a, sub) for a in _flag_actions(sub)]))
            if sub.epilog:
                out.extend(["```text", sub.epilog.strip("\n"), "```", ""])
        if not own and not shared and not parser._subparsers:
            out.extend(["It has no flags of its own.", ""])

    for name in MAIN_COMMANDS:
        command_section(name, "##")

    for block in (server, engine):
        commands_text = _and([f"[afd {c}](#{_anchor(c)})" for c in block.commands])
        out.extend(
            [
                f"## {block.title}",
                "",
                f"Taken by {commands_text}: the fields of `{block.source}`, in the order the class defines them.",
                "",
                *_table(block.rows or []),
            ]
        )

    out.extend(_yaml_section(commands, engine, server))

    out.extend(["## Other commands", ""])
    for name in commands:
        if name not in MAIN_COMMANDS:
            command_section(name, "###")
    return "\n".join(out).rstrip("\n") + "\n"


def _yaml_section(commands: dict, engine: _Shared, server: _Shared) -> list[str]:
    with_config = [n for n, (p, _) in commands.items() if any(a.dest == "config" for a in p._actions)]
    keys = {n: _yaml_keys(commands[n][0]) for n in with_config}
    required = {
        n: [a.option_strings[0] for a in _flag_actions(commands[n][0]) if a.required and a.option_strings]
        for n in with_config
    }
    required = {n: flags for n, flags in required.items() if flags}
    names = _and([f"`afd {n}`" for n in with_config])
    out = [
        "## YAML configuration files",
        "",
        f"{names} take `--config FILE`: a YAML file that maps settings to values, so that a deployment can",
        "be written down once and started with one flag. A key is a flag's name without the leading dashes,",
        "with dashes or underscores alike (`dp-size` or `dp_size`). Switches take `true` or `false`, and",
        "flags that may be repeated take a list.",
        "",
        "- The file fills in every setting that the command line left at its default: a flag given on the",
        "  command line with another value wins over the file, and the file wins over the defaults. A flag",
        "  given on the command line with exactly its default value does not override the file (the two",
        "  cannot be told apart).",
        "- A key that the command does not accept is refused, with the list of the keys it accepts. The",
        "  values of engine and server settings are checked for type and choices when the file is read",
        "  (the error names the file and the key); the engine then validates the combined settings as it",
        "  does flags. The values of a command's other keys are taken as written.",
    ]
    if required:
        flags = "; ".join(f"{_and([f'`{o}`' for o in opts])} of `afd {n}`" for n, opts in required.items())
        out += [
            "- Required flags must be on the command line, since the parser checks them before the file is",
            f"  read: {flags}.",
        ]
    out += ["", "Keys each command accepts:", "", "| Keys | Accepted by |", "| --- | --- |"]
    # keys grouped by the commands that accept them (and by the block of flags they come from)
    groups: dict[tuple, list[str]] = {}
    for key in dict.fromkeys(k for n in with_config for k in keys[n]):
        block = next((b for b in (server, engine) if key in b.names), None)
        groups.setdefault((tuple(n for n in with_config if key in keys[n]), block), []).append(key)
    for (takers, block), group in groups.items():
        label = ", ".join(f"`{k}`" for k in group)
        if block is not None and set(group) == block.names:
            label = f"the {block.link()}: {label}"
        out.append(f"| {label} | {', '.join(f'`afd {n}`' for n in takers)} |")
    out += ["", "The repository ships two examples in `configs/`:", ""]
    for path in sorted((REPO_ROOT / "configs").glob("*.yaml")):
        out += [f"`configs/{path.name}`:", "", "```yaml", path.read_text().rstrip("\n"), "```", ""]
    out += [
        "A file, with a flag on the command line that wins over it:",
        "",
        "<!-- not run: starts a long-running server -->",
        "```bash",
        "afd serve --config configs/afd_2a_2x2.yaml --micro-batches 2",
        "```",
        "",
        "A file of your own; keys with dashes and with underscores mix freely:",
        "",
        "```bash",
        'dir="$(mktemp -d)"',
        "cat > \"$dir/small.yaml\" <<'EOF'",
        "max-running-requests: 8",
        "kv_cache_memory_mb: 64",
        "schedule-policy: fcfs",
        "EOF",
        'afd generate --config "$dir/small.yaml" --prompt "def fibonacci(n):" --max-new-tokens 8 --temperature 0',
        'rm -r "$dir"',
        "```",
        "",
    ]
    return out


# -- command line ----------------------------------------------------------------------------------


def check(page: Path = PAGE) -> list[str]:
    """What differs between `page` and the page the code generates now, as a unified diff (empty
    when the page is current)."""
    want = render()
    have = page.read_text() if page.is_file() else ""
    return list(
        difflib.unified_diff(
            have.splitlines(), want.splitlines(), f"{page} (on disk)", f"{page} (generated)", lineterm=""
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m afd_engine.flags_doc", description="the flags reference page, generated from the parsers"
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(REPO_ROOT)}")
    what.add_argument("--check", action="store_true", help="exit 1, with a diff, when the page is stale")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page's path (default: %(default)s)")
    ns = parser.parse_args(argv)
    if ns.check:
        diff = check(ns.page)
        if not diff:
            print(f"{ns.page} is current")
            return 0
        shown = diff[:200]
        print("\n".join(shown), file=sys.stderr)
        if len(diff) > len(shown):
            print(f"... ({len(diff) - len(shown)} more diff lines)", file=sys.stderr)
        print(f"{ns.page} is stale: regenerate it with `{COMMAND}`", file=sys.stderr)
        return 1
    text = render()
    if ns.write:
        ns.page.parent.mkdir(parents=True, exist_ok=True)
        ns.page.write_text(text)
        print(f"wrote {ns.page}")
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
