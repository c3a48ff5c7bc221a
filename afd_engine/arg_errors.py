"""The argument parser every `afd` command uses: a bad argument prints one line, not the usage.

argparse's own `error()` prints the whole usage before the message; for `afd serve`, whose usage
lists every engine flag, that buries the one line that matters under a screenful of text. Here a
bad flag, a value outside a flag's choices, a missing required argument or an unknown flag prints

    afd serve: error: argument --dtype: invalid choice: 'float16' (choose from 'auto', 'float32', 'bfloat16')

and exits with status 2, the same shape as the engine's own user errors; `--help` still prints the
full usage. Subcommand parsers inherit the class (`add_subparsers` builds them with the parent's).
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class _Subcommands(argparse._SubParsersAction):
    """Subcommands whose unknown flags are refused by the subcommand's own parser, so the error
    names the command the flag was given to (`afd serve: ...`), not the top-level program."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        # argparse leaves a subcommand's leftovers on the namespace for the top-level parser
        extras = getattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if extras:
            self.choices[values[0]].error(f"unrecognized arguments: {' '.join(extras)}")


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors are one line on stderr, `PROG: error: MESSAGE`, exit 2."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Subcommands)

    def error(self, message: str) -> NoReturn:
        # a message that spans lines (a type converter's exception text) is joined so the
        # one-line promise holds whatever raised it
        self.exit(2, f"{self.prog}: error: {' '.join(message.splitlines())}\n")
