"""Strict reading of the JSON a model writes inside its tool calls."""

from __future__ import annotations

import json


def _reject_constant(name: str) -> float:
    """NaN and Infinity are accepted by Python's json but are not JSON; a client could not parse them."""
    raise ValueError(f"{name} is not JSON")


# Shared by the formats that need to know where a JSON value ends (`raw_decode`), not only whether
# the text is JSON.
DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def json_object(text: str) -> dict | None:
    """`text` decoded when it is exactly one JSON object (surrounding whitespace allowed)."""
    try:
        value, end = DECODER.raw_decode(text, skip_space(text, 0))
    except ValueError:
        return None
    if not isinstance(value, dict) or text[end:].strip():
        return None
    return value


def skip_space(text: str, pos: int) -> int:
    """Index of the first non-whitespace character at or after `pos`."""
    return len(text) - len(text[pos:].lstrip()) if pos < len(text) else pos
