"""Detection of tool calls in a reply, whole or streamed, for any format.

Text before the first call is the message's content. How content and calls are told apart
(`ToolCallStream` is the one definition; `parse_tool_calls` runs it over the whole text):

- A call whose body does not parse (bad JSON, arguments not an object) stays in the content as the
  raw text the model wrote, so nothing the model said is lost and nothing raises.
- An unfinished call at the end (the model stopped early) is content as well.
- When there are calls, whitespace that only separates content from a call, calls from each other,
  or ends the text, is dropped; content that is empty or only whitespace is None.
- Arguments are the JSON text the model wrote (stripped), not a re-serialisation: re-encoding
  could change numbers (``1e400`` would come back as the invalid ``Infinity``).
"""

from __future__ import annotations

from afd_engine.server.tool_calls.core_types import Delta, ToolCall
from afd_engine.server.tool_calls.json_text import skip_space
from afd_engine.server.tool_calls.registry import get_detector


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """Split a finished reply into its content (None if empty or whitespace) and its tool calls.

    Runs the streaming parser over the whole text, so a streamed reply and a whole one can never
    disagree.
    """
    stream = ToolCallStream(parser)
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.content for d in deltas if d.content is not None)
    names = [d.name for d in deltas if d.name is not None]
    arguments = ["" for _ in names]
    for d in deltas:
        if d.arguments is not None:
            arguments[d.index] += d.arguments
    return content or None, [ToolCall(n, a) for n, a in zip(names, arguments)]


_CONTENT, _SECTION, _CALL = "content", "section", "call"


class ToolCallStream:
    """Incremental tool-call parsing of a streamed reply, delta by delta.

    Content is passed on as soon as it cannot be part of a call: only a possible beginning of the
    trigger, and whitespace that may turn out to precede a call, are held back. A call is passed on
    whole (its name, then its arguments in one piece) once its closing marker arrives, because
    only then is it known to be a call rather than malformed text that belongs to the content.
    Any chunking of the same text gives the same content and calls.
    """

    def __init__(self, parser: str) -> None:
        self._format = get_detector(parser)
        self._state = _CONTENT
        self._buf = ""  # text not yet looked at
        self._held = ""  # text looked at but not decided: whitespace, or the raw start of a call
        self._section_open = False  # `_held` holds the section's opening marker, no call decided yet
        self._calls = 0
        self._content_sent = False

    def feed(self, delta: str) -> list[Delta]:
        """Take the next piece of generated text; return what is now decided."""
        self._buf += delta
        out: list[Delta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        """End of the reply: whatever is still undecided is content (an unfinished call included)."""
        out: list[Delta] = []
        rest = self._held + self._buf
        self._held = self._buf = ""
        self._state = _CONTENT
        if self._calls:
            rest = rest.rstrip()
        elif not self._content_sent and not rest.strip():
            rest = ""  # a reply of only whitespace has no content
        self._send_content(out, rest)
        return out

    def _step(self, out: list[Delta]) -> bool:
        """Advance by one decision; False when more text is needed."""
        if self._state == _CONTENT:
            return self._step_content(out)
        if self._state == _SECTION:
            return self._step_section(out)
        return self._step_call(out)

    def _step_content(self, out: list[Delta]) -> bool:
        trigger = self._format.trigger
        at = self._buf.find(trigger)
        if at < 0:
            keep = _partial_suffix(self._buf, trigger)
            self._add_content(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._add_content(out, self._buf[:at])
        self._held += trigger
        self._buf = self._buf[at + len(trigger) :]
        if self._format.section_end is None:
            self._state = _CALL
        else:
            self._state, self._section_open = _SECTION, True
        return True

    def _step_section(self, out: list[Delta]) -> bool:
        """Between a section's calls: the next call, the section's end, or text that ends the section."""
        fmt = self._format
        assert fmt.section_end is not None  # only formats with sections get here
        start = skip_space(self._buf, 0)
        rest = self._buf[start:]
        if rest.startswith(fmt.call_begin):
            self._held += self._buf[: start + len(fmt.call_begin)]
            self._buf = self._buf[start + len(fmt.call_begin) :]
            self._state = _CALL
            return True
        if rest.startswith(fmt.section_end):
            end = start + len(fmt.section_end)
            if self._section_open:  # a section without calls is just text
                self._release(out, self._buf[:end])
            else:
                self._held = ""
            self._buf = self._buf[end:]
            self._state = _CONTENT
            return True
        if fmt.call_begin.startswith(rest) or fmt.section_end.startswith(rest):
            return False
        self._release(out, self._buf[:start])
        self._buf = rest
        self._state = _CONTENT
        return True

    def _step_call(self, out: list[Delta]) -> bool:
        fmt = self._format
        at = self._buf.find(fmt.call_end)
        if at < 0:
            return False
        body = self._buf[:at]
        self._buf = self._buf[at + len(fmt.call_end) :]
        call = fmt.parse_body(body)
        if call is None:
            self._release(out, body + fmt.call_end)
        else:
            self._held = ""
            out.append(Delta(index=self._calls, name=call.name))
            out.append(Delta(index=self._calls, arguments=call.arguments))
            self._calls += 1
        self._section_open = False
        self._state = _CONTENT if fmt.section_end is None else _SECTION
        return True

    def _release(self, out: list[Delta], text: str) -> None:
        """The held raw text and `text` turned out not to be a call: they are content."""
        raw = self._held + text
        self._held = ""
        self._add_content(out, raw)

    def _add_content(self, out: list[Delta], text: str) -> None:
        """Send content up to its last non-space character; hold the trailing whitespace."""
        text = self._held + text
        head = text.rstrip()
        self._send_content(out, head)
        self._held = text[len(head) :]

    def _send_content(self, out: list[Delta], text: str) -> None:
        if not text:
            return
        self._content_sent = True
        if out and out[-1].content is not None:
            out[-1] = Delta(content=out[-1].content + text)
        else:
            out.append(Delta(content=text))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
