"""Validation of a request's ``tools`` and ``tool_choice``, each schema compiled as the engine would."""

from __future__ import annotations

import json
import re

from afd_engine.runtime.grammar import build_grammar

# What OpenAI accepts as a function name; it also keeps names free of characters that would need
# escaping inside the formats' literal text.
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_TOOL_NAME_RE = re.compile(TOOL_NAME_PATTERN)

TOOL_CHOICES = ("none", "auto", "required")

# The arguments schema of a function declared without parameters: an object with no fields.
_NO_PARAMETERS: dict = {"type": "object", "properties": {}}


def function_parameters(function: dict) -> dict:
    """The arguments schema; a function without parameters (absent or ``{}``) takes an empty object."""
    return function.get("parameters") or _NO_PARAMETERS


def check_tools(tools: list) -> list[dict]:
    """Validate a request's ``tools``; returns them unchanged, or raises ValueError naming the field.

    Every schema is compiled here so that a bad one is the client's 400, not a failure inside the
    engine's grammar compilation later.
    """
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = _check_tool(tool, f"tools[{i}]")
        if name in seen:
            raise ValueError(f"tools[{i}].function.name {name!r} is used by an earlier tool")
        seen.add(name)
    return tools


def _check_tool(tool: object, where: str) -> str:
    """Check one tool; returns its function's name."""
    if not isinstance(tool, dict):
        raise ValueError(f"{where} must be an object")
    if tool.get("type") != "function":
        raise ValueError(f"{where}.type must be 'function'")
    function = tool.get("function")
    if function is None:
        raise ValueError(f"{where}.function is required")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function must be an object")
    name = _check_name(function.get("name"), f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{where}.function.strict must be a boolean")
    _check_parameters(function.get("parameters"), f"{where}.function.parameters")
    return name


def _check_name(name: object, where: str) -> str:
    if name is None or name == "":
        raise ValueError(f"{where} is required")
    if not isinstance(name, str):
        raise ValueError(f"{where} must be a string")
    if not _TOOL_NAME_RE.match(name):
        raise ValueError(f"{where} {name!r} must match {TOOL_NAME_PATTERN}")
    return name


def _check_parameters(parameters: object, where: str) -> None:
    if parameters is None:
        return
    if not isinstance(parameters, dict):
        raise ValueError(f"{where} must be an object")
    try:
        build_grammar("json_schema", json.dumps(parameters))
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{where} is not a usable JSON schema: {_xgrammar_message(e)}") from None


def _xgrammar_message(error: Exception) -> str:
    """xgrammar's error without its timestamp and C++ source location."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    message = lines[-1] if lines else type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", message)


def check_tool_choice(tool_choice: object, tools: list[dict] | None) -> str | dict:
    """Validate ``tool_choice`` against the (already checked) tools; returns the choice.

    Unset means "auto" with tools and "none" without, as in OpenAI's API.
    """
    tools = tools or []
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function")
        if tool_choice == "required" and not tools:
            raise ValueError("tool_choice 'required' needs at least one tool in tools")
        return tool_choice
    if not isinstance(tool_choice, dict):
        raise ValueError("tool_choice must be a string or an object")
    if tool_choice.get("type") != "function":
        raise ValueError("tool_choice.type must be 'function'")
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise ValueError("tool_choice.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("tool_choice.function.name is required")
    if all(tool["function"]["name"] != name for tool in tools):
        raise ValueError(f"tool_choice.function.name {name!r} is not one of the tools")
    return tool_choice
