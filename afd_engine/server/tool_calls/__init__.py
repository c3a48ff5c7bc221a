"""Tool calling for the OpenAI chat API: constrain, parse, stream and render tool calls.

A model calls tools by writing them in the text format it was trained on; the server's job is to
keep that text well-formed (a structural tag for xgrammar, `tool_call_guide`), to cut it back into
OpenAI ``tool_calls`` (`parse_tool_calls`, `ToolCallStream` for streaming) and, for chat templates
that know nothing of tools, to describe the tools and the format in a system message
(`tools_system_prompt`) and write earlier calls back as text (`render_tool_calls`).

Each format is one detector (`base.ToolCallDetector`: ``deepseekv3.py``, ``qwen25.py``), looked up
by its ``--tool-call-parser`` name in ``registry.py``; the shared parts are detection
(``stream.py``), the guide (``guide.py``), the prompts (``prompts.py``) and the validation of a
request's tools (``validation.py``).
"""

from afd_engine.server.tool_calls.core_types import Delta, ToolCall
from afd_engine.server.tool_calls.guide import tool_call_guide
from afd_engine.server.tool_calls.prompts import (
    default_tool_messages,
    render_tool_calls,
    template_supports_tools,
    tools_system_prompt,
)
from afd_engine.server.tool_calls.registry import PARSERS
from afd_engine.server.tool_calls.stream import ToolCallStream, parse_tool_calls
from afd_engine.server.tool_calls.validation import check_tool_choice, check_tools

__all__ = [
    "PARSERS",
    "Delta",
    "ToolCall",
    "ToolCallStream",
    "check_tool_choice",
    "check_tools",
    "default_tool_messages",
    "parse_tool_calls",
    "render_tool_calls",
    "template_supports_tools",
    "tool_call_guide",
    "tools_system_prompt",
]
