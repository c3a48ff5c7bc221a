"""The constrained-decoding guide of tool calls: an xgrammar structural tag built from a format's
literal text and the tools' argument schemas."""

from __future__ import annotations

import json

from afd_engine.server.tool_calls.base import ToolCallDetector
from afd_engine.server.tool_calls.registry import get_detector
from afd_engine.server.tool_calls.validation import TOOL_CHOICES, function_parameters


def tool_call_guide(parser: str, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool) -> str | None:
    """The xgrammar structural tag (JSON text) that keeps the model's tool calls well-formed.

    "auto" leaves free text free until the format's trigger, after which a call to one of `tools`
    with arguments valid for its schema must follow; "required" and a named function allow only
    calls (at least one), so the reply cannot dodge the choice. Without parallel calls exactly one
    call is allowed and generation ends after it. None means nothing to constrain ("none", or
    "auto" with no tools).
    """
    detector = get_detector(parser)
    if tool_choice == "none" or (tool_choice == "auto" and not tools):
        return None
    forced = tool_choice != "auto"
    calls = [_call_tag(detector, tool) for tool in _allowed_tools(tools, tool_choice)]
    one = not parallel_tool_calls
    sequence = {
        "type": "tags_with_separator",
        "tags": calls,
        "separator": detector.separator,
        "at_least_one": True,
        "stop_after_first": one,
    }
    if detector.section_end is None:
        if forced:
            return _structural_tag(sequence)
        return _structural_tag(_triggered(detector, calls, one))
    section = {"type": "tag", "begin": detector.trigger, "content": sequence, "end": detector.section_end}
    return _structural_tag(section if forced else _triggered(detector, [section], one))


def _allowed_tools(tools: list[dict], tool_choice: str | dict) -> list[dict]:
    """The tools a call may name: all of them, or only the one a named tool_choice picks."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tools = [tool for tool in tools if tool["function"]["name"] == name]
        if not tools:
            raise ValueError(f"tool_choice.function.name {name!r} is not one of the tools")
    elif tool_choice not in ("auto", "required"):
        raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function")
    if not tools:
        raise ValueError(f"tool_choice {tool_choice!r} needs at least one tool")
    return tools


def _call_tag(detector: ToolCallDetector, tool: dict) -> dict:
    """One call of `tool`: its literal prefix, arguments valid against its schema, the suffix."""
    function = tool["function"]
    return {
        "type": "tag",
        "begin": detector.call_prefix(function["name"]),
        # one whitespace character at most between tokens: a model that would pad with blank lines
        # forever cannot, and every well-formed JSON layout but pretty-printing still fits
        "content": {"type": "json_schema", "json_schema": function_parameters(function), "max_whitespace_cnt": 1},
        "end": detector.call_suffix,
    }


def _triggered(detector: ToolCallDetector, tags: list[dict], one: bool) -> dict:
    """Free text in which `detector.trigger` starts one of `tags` (for tool_choice "auto")."""
    return {
        "type": "triggered_tags",
        "triggers": [detector.trigger],
        "tags": tags,
        "at_least_one": False,
        "stop_after_first": one,
    }


def _structural_tag(format_: dict) -> str:
    return json.dumps({"type": "structural_tag", "format": format_}, ensure_ascii=False)
