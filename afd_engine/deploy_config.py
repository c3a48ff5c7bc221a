"""Deployments described in YAML (see configs/*.yaml): EngineArgs fields by name.

Keys use the flag names with underscores or dashes (`dp_size` or `dp-size`). Flags given on the
command line win over the file; the file wins over the defaults.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import yaml

from afd_engine.engine_args import EngineArgs, setting_error
from afd_engine.errors import ConfigError


def _settings_class_of() -> dict:
    """Field name -> the settings dataclass (EngineArgs, ServerArgs) it belongs to."""
    from afd_engine.server.serve import ServerArgs

    return {f.name: cls for cls in (EngineArgs, ServerArgs) for f in fields(cls)}


def load_config(path: str | Path, allowed: set[str]) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"deployment config {str(path)!r} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(raw).__name__}")
    values = {str(k).replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ConfigError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(allowed))}")
    owners = _settings_class_of()
    for key, value in values.items():
        error = key in owners and setting_error(owners[key], key, value)
        if error:
            raise ConfigError(f"{path}: {key}: {value!r} {error}")
    return values


def accepted_keys(dests) -> list[str]:
    """The keys a configuration file may set for a command whose parser has destinations `dests`:
    each of them (but the command and the file itself), then every engine setting, in order."""
    ordered = dict.fromkeys([*dests, *sorted(f.name for f in fields(EngineArgs))])
    return [k for k in ordered if k not in ("command", "config")]


def apply_config(ns: argparse.Namespace, parser_defaults: dict) -> None:
    """Fills the namespace from `ns.config` wherever the command line left a default."""
    if not getattr(ns, "config", None):
        return
    names = set(accepted_keys(vars(ns)))
    for key, value in load_config(ns.config, names).items():
        if getattr(ns, key, None) == parser_defaults.get(key):
            setattr(ns, key, value)
