"""Configuration files shipped with the engine (JSON presets), and a helper to read them."""

from __future__ import annotations

import json
from pathlib import Path


def load_json(name: str) -> dict:
    """Return the parsed contents of the JSON file `name` that lives in this package folder."""
    # Path(__file__).parent works both from a source checkout and from an installed package,
    # since pyproject.toml ships configs/*.json as package data.
    return json.loads((Path(__file__).parent / name).read_text(encoding="utf-8"))
