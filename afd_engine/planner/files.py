"""Reading the planner's input files with one-line errors that name the flag."""

from __future__ import annotations

import json
from pathlib import Path

from afd_engine.errors import ConfigError


def read_json(path: str | Path, flag: str):
    """The JSON document at `path`; ConfigError "<flag> <path>: ..." when it is missing or not JSON."""
    where = f"{flag} {path}"
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where}: not a JSON file ({exc})") from None
