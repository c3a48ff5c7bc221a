"""Qwen 2.5's tool calls (``--tool-call-parser qwen25``).

``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``, calls separated by ``\\n``.
Tool results go back in a ``<tool_response>`` block, as Qwen's own templates write them.
"""

from __future__ import annotations

import json
import re

from afd_engine.server.tool_calls.base import ToolCallDetector
from afd_engine.server.tool_calls.core_types import ToolCall
from afd_engine.server.tool_calls.json_text import DECODER, json_object

_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*')
_ARGS_KEY_RE = re.compile(r'\s*,\s*"arguments"\s*:\s*')
_TAIL_RE = re.compile(r"\s*\}\s*")


class Qwen25Detector(ToolCallDetector):
    """Each call a ``<tool_call>`` block holding one JSON object of name and arguments."""

    trigger = "<tool_call>"
    call_begin = "<tool_call>"
    call_end = "</tool_call>"
    section_end = None
    separator = "\n"
    call_suffix = "}\n</tool_call>"
    result_begin = "<tool_response>\n"
    result_end = "\n</tool_response>"

    def call_prefix(self, name: str) -> str:
        return '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '

    def parse_body(self, body: str) -> ToolCall | None:
        """Read ``{"name": ..., "arguments": {...}}``."""
        obj = json_object(body)
        if obj is None or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        if not isinstance(obj.get("arguments"), dict):
            return None
        arguments = _arguments_text(body)
        if arguments is None:  # keys in another order: no single span to quote, so re-encode
            arguments = json.dumps(obj["arguments"], ensure_ascii=False)
        return ToolCall(obj["name"], arguments)


def _arguments_text(body: str) -> str | None:
    """The arguments' text as written, when the body has the usual name-then-arguments layout.

    The body is already known to be valid JSON, so matching the layout around the two values is
    enough to know the span is exactly the arguments object.
    """
    head = _HEAD_RE.match(body)
    if head is None:
        return None
    try:
        _, pos = DECODER.raw_decode(body, head.end())
        key = _ARGS_KEY_RE.match(body, pos)
        if key is None:
            return None
        _, end = DECODER.raw_decode(body, key.end())
    except ValueError:
        return None
    if _TAIL_RE.fullmatch(body, end) is None:
        return None
    return body[key.end() : end]
