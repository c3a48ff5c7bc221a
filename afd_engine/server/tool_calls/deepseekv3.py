"""DeepSeek-V2/V3's tool calls (``--tool-call-parser deepseekv3``).

``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``
with further calls after a ``\\n``, closed by ``<｜tool▁calls▁end｜>`` (the bars are U+FF5C, the
``▁`` is U+2581). Tool results go back between DeepSeek-V3's output markers.
"""

from __future__ import annotations

import re

from afd_engine.server.tool_calls.base import ToolCallDetector
from afd_engine.server.tool_calls.core_types import ToolCall
from afd_engine.server.tool_calls.json_text import json_object

_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_CALLS_END = "<｜tool▁calls▁end｜>"
_CALL_BEGIN = "<｜tool▁call▁begin｜>"
_CALL_END = "<｜tool▁call▁end｜>"
_SEP = "<｜tool▁sep｜>"

# Body of a call: ``function<｜tool▁sep｜>NAME\n```json\nARGS\n```. The type word and the fence's
# language are optional, so that a near miss still counts as a call.
_BODY_RE = re.compile(
    r"\s*(?:function)?\s*" + re.escape(_SEP) + r"\s*(?P<name>[^\s`]+)\s*```(?:json)?(?P<args>.*?)```\s*",
    re.DOTALL,
)


class DeepSeekV3Detector(ToolCallDetector):
    """Calls in a section, each a type word, the name and a fenced JSON object."""

    trigger = _CALLS_BEGIN
    call_begin = _CALL_BEGIN
    call_end = _CALL_END
    section_end = _CALLS_END
    separator = "\n"
    call_suffix = f"\n```{_CALL_END}"
    result_begin = "<｜tool▁output▁begin｜>"
    result_end = "<｜tool▁output▁end｜>"

    def call_prefix(self, name: str) -> str:
        return f"{_CALL_BEGIN}function{_SEP}{name}\n```json\n"

    def parse_body(self, body: str) -> ToolCall | None:
        """Read ``function<｜tool▁sep｜>NAME`` and the fenced JSON object."""
        match = _BODY_RE.fullmatch(body)
        if match is None or json_object(match["args"]) is None:
            return None
        return ToolCall(match["name"], match["args"].strip())
