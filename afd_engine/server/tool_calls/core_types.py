"""What parsing a reply yields: whole tool calls, and the pieces a streamed reply is cut into."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """One call as the client sees it: `arguments` is the JSON object's text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Delta:
    """One piece of streamed output: either content text, or part of the call at `index`.

    The first piece of each call carries its `name`; `arguments` pieces concatenate to the call's
    arguments text.
    """

    content: str | None = None
    index: int | None = None
    name: str | None = None
    arguments: str | None = None
