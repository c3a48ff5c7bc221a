"""The prompt side of tool calls, for chat templates that know nothing of tools: the tools and the
call format described in a system message, earlier calls and tool results written back as text."""

from __future__ import annotations

import json
import re

from afd_engine.server.tool_calls.core_types import ToolCall
from afd_engine.server.tool_calls.registry import get_detector
from afd_engine.server.tool_calls.validation import function_parameters


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders tools itself (it refers to `tools`).

    A template that never mentions them would silently drop the tools, so the server has to
    describe them in a system message instead.
    """
    return chat_template is not None and re.search(r"\btools\b", chat_template) is not None


def tools_system_prompt(parser: str, tools: list[dict]) -> str:
    """A default system message that lists `tools` and shows the parser's exact call syntax.

    For models whose chat template cannot render tools: the model learns from this text what it
    may call and how, in the format that `parse_tool_calls` reads back. Each tool is one signature
    line (``name(arg: type, optional?: "a"|"b") - description``) rather than its JSON schema: a
    fraction of the tokens, which matters to small-context models, while the grammar of the
    request, not the prompt, is what holds the arguments to the schema.
    """
    example = render_tool_calls(parser, [ToolCall("<name>", "<arguments as a JSON object>")])
    listing = "\n".join(_signature(tool["function"]) for tool in tools)
    return f"You may call these functions:\n{listing}\nTo call one, reply with:\n{example}"


def _signature(function: dict) -> str:
    params = function_parameters(function)
    required = set(params.get("required", ()))
    args = [
        f"{name}{'' if name in required else '?'}: {_type_text(schema)}"
        for name, schema in (params.get("properties") or {}).items()
    ]
    line = f"{function['name']}({', '.join(args)})"
    return f"{line} - {function['description']}" if function.get("description") else line


def _type_text(schema: object) -> str:
    """A short reading of a property's schema: its enum values, or its type."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return "|".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"], ensure_ascii=False)
    kind = schema.get("type", "any")
    if kind == "array":
        return f"{_type_text(schema.get('items'))}[]"
    return kind if isinstance(kind, str) else "|".join(map(str, kind))


def render_tool_calls(parser: str, calls: list[ToolCall]) -> str:
    """The exact text of `calls` in the parser's format (an earlier assistant turn, written back).

    `parse_tool_calls` reads this text back as the same calls.
    """
    return get_detector(parser).render(calls)


def render_tool_result(parser: str, content: str) -> str:
    """A tool's result as the text of the turn that hands it back, in the parser's family format."""
    return get_detector(parser).render_result(content)


def default_tool_messages(parser: str, messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation for a chat template that cannot render tools (the documented default):
    the tools described in a first system message, an assistant turn's calls written into its
    content in the parser's format, and each tool result as a user turn of its own."""
    out = [{"role": "system", "content": tools_system_prompt(parser, tools)}] if tools else []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": render_tool_result(parser, m["content"])})
        elif m.get("tool_calls"):
            calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            rest = {k: v for k, v in m.items() if k not in ("tool_calls", "content")}
            out.append({**rest, "content": m["content"] + render_tool_calls(parser, calls)})
        else:
            out.append(m)
    return out
