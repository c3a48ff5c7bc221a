"""The tool-call formats the CLI and API accept, by name (SGLang's ``--tool-call-parser`` values)."""

from __future__ import annotations

from afd_engine.server.tool_calls.base import ToolCallDetector
from afd_engine.server.tool_calls.deepseekv3 import DeepSeekV3Detector
from afd_engine.server.tool_calls.qwen25 import Qwen25Detector

DETECTORS: dict[str, type[ToolCallDetector]] = {
    "deepseekv3": DeepSeekV3Detector,
    "qwen25": Qwen25Detector,
}

PARSERS: tuple[str, ...] = tuple(DETECTORS)


def get_detector(parser: str) -> ToolCallDetector:
    """The detector of the format named `parser`; ValueError naming the known formats otherwise."""
    try:
        detector = DETECTORS[parser]
    except KeyError:
        raise ValueError(f"unknown tool call parser {parser!r}; known: {', '.join(PARSERS)}") from None
    return detector()
