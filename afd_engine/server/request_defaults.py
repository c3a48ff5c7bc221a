"""What a request leaves unset: the checkpoint's sampling defaults, and which logit-processing
fields a request sets (the request models in protocol.py read both)."""

from __future__ import annotations

import json
import pathlib
from typing import Any


def _processing(fields) -> dict[str, Any]:
    """The logit-processing SamplingParams of a request (or /generate's sampling_params) that sets them."""
    out = {name: getattr(fields, name) for name in _PROCESSING if getattr(fields, name, None) is not None}
    if getattr(fields, "min_new_tokens", None) is not None:  # SGLang's name
        out["min_tokens"] = fields.min_new_tokens
    return out


_PROCESSING = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias")


def _or_default(value, name: str, model_defaults: dict | None):
    return value if value is not None or not model_defaults else model_defaults.get(name)


def generation_defaults(model_path) -> dict[str, float | int]:
    """The sampling defaults a checkpoint's generation_config.json declares (temperature, top_p,
    top_k; none when it says do_sample false), for request fields left unset, as vLLM does."""
    path = pathlib.Path(model_path) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict) or config.get("do_sample") is False:
        return {}
    return {k: config[k] for k in ("temperature", "top_p", "top_k") if isinstance(config.get(k), (int, float))}
