"""What a tool-call format must provide: its literal markers and how to read one call's body.

Everything else is shared and built on these pieces, so that every format is detected, streamed,
constrained and rendered the same way:

- detection in a full text and in a streamed increment (`stream.py`) finds `trigger`, cuts calls
  at `call_begin`/`call_end` (inside a `section_end`-closed section for sectioned formats) and
  reads each body with `parse_body`;
- the constrained-decoding guide (`guide.py`) allows `call_prefix(name)` + arguments +
  `call_suffix`, joined by `separator`, after `trigger`;
- the prompt text for chat templates without tools (`prompts.py`) shows calls as `render` writes
  them and tool results as `render_result` wraps them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from afd_engine.server.tool_calls.core_types import ToolCall


class ToolCallDetector(ABC):
    """One tool-call format.

    `trigger` opens the tool calls in free text. Calls are `call_begin` BODY `call_end`; when
    `section_end` is set the calls sit in a section that `trigger` opens and `section_end` closes,
    otherwise each call stands alone and `trigger` is its `call_begin`. `call_prefix(name)` +
    ARGS + `call_suffix` is the exact text of one call, `separator` what goes between calls.
    `result_begin` + RESULT + `result_end` hands a tool's result back to the model.
    """

    trigger: ClassVar[str]
    call_begin: ClassVar[str]
    call_end: ClassVar[str]
    section_end: ClassVar[str | None]
    separator: ClassVar[str]
    call_suffix: ClassVar[str]
    result_begin: ClassVar[str]
    result_end: ClassVar[str]

    @abstractmethod
    def call_prefix(self, name: str) -> str:
        """The exact text of a call of `name` up to its arguments."""

    @abstractmethod
    def parse_body(self, body: str) -> ToolCall | None:
        """The call written between `call_begin` and `call_end`; None when it is malformed.

        A None keeps the raw text in the message's content, so nothing the model said is lost.
        """

    def render(self, calls: list[ToolCall]) -> str:
        """The exact text of `calls` in this format; detection reads it back as the same calls."""
        text = self.separator.join(self.call_prefix(c.name) + c.arguments + self.call_suffix for c in calls)
        if self.section_end is None:
            return text
        return self.trigger + text + self.section_end

    def render_result(self, content: str) -> str:
        """A tool's result as the text of the turn that hands it back."""
        return self.result_begin + content + self.result_end
