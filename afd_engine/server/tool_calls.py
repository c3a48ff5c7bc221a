"""Tool calling for the OpenAI chat API: constrain, parse, stream and render tool calls.

A model calls tools by writing them in the text format it was trained on; the server's job is to
keep that text well-formed (a structural tag for xgrammar, see `tool_call_guide`), to cut it back
into OpenAI ``tool_calls`` (`parse_tool_calls`, `ToolCallStream` for streaming) and, for chat
templates that know nothing of tools, to describe the tools and the format in a system message
(`tools_system_prompt`) and write earlier calls back as text (`render_tool_calls`).

Two formats are known, named as SGLang's ``--tool-call-parser`` values:

``deepseekv3``
    ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``
    with further calls after a ``\\n``, closed by ``<｜tool▁calls▁end｜>`` (the bars are U+FF5C,
    the ``▁`` is U+2581).
``qwen25``
    ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``, calls separated by ``\\n``.

In both, text before the first call is the message's content. How content and calls are told apart
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

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from afd_engine.runtime.grammar import build_grammar

__all__ = [
    "PARSERS",
    "TOOL_CHOICES",
    "TOOL_NAME_PATTERN",
    "Delta",
    "ToolCall",
    "ToolCallStream",
    "check_tool_choice",
    "check_tools",
    "parse_tool_calls",
    "render_tool_calls",
    "template_supports_tools",
    "tool_call_guide",
    "tools_system_prompt",
]

PARSERS: tuple[str, ...] = ("deepseekv3", "qwen25")

# What OpenAI accepts as a function name; it also keeps names free of characters that would need
# escaping inside the formats' literal text.
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_TOOL_NAME_RE = re.compile(TOOL_NAME_PATTERN)

# The arguments schema of a function declared without parameters: an object with no fields.
_NO_PARAMETERS: dict = {"type": "object", "properties": {}}

TOOL_CHOICES = ("none", "auto", "required")


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


# --- the two formats -------------------------------------------------------------------------


def _reject_constant(name: str) -> float:
    """NaN and Infinity are accepted by Python's json but are not JSON; a client could not parse them."""
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _json_object(text: str) -> dict | None:
    """`text` decoded when it is exactly one JSON object (surrounding whitespace allowed)."""
    try:
        value, end = _DECODER.raw_decode(text, _skip_space(text, 0))
    except ValueError:
        return None
    if not isinstance(value, dict) or text[end:].strip():
        return None
    return value


def _skip_space(text: str, pos: int) -> int:
    """Index of the first non-whitespace character at or after `pos`."""
    return len(text) - len(text[pos:].lstrip()) if pos < len(text) else pos


@dataclass(frozen=True)
class _Format:
    """The literal text of one tool-call format, and how to read a call's body.

    `trigger` opens the tool calls in free text. Calls are `call_begin` BODY `call_end`; when
    `section_end` is set (DeepSeek) the calls sit in a section that `trigger` opens and
    `section_end` closes, otherwise each call stands alone and `trigger` is its `call_begin`.
    `call_prefix(name)` + ARGS + `call_suffix` is the exact text of one call (for guides and
    rendering), `separator` what goes between calls.
    """

    trigger: str
    call_begin: str
    call_end: str
    section_end: str | None
    separator: str
    call_prefix: Callable[[str], str]
    call_suffix: str
    parse_body: Callable[[str], ToolCall | None]


_QWEN_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*')
_QWEN_ARGS_KEY_RE = re.compile(r'\s*,\s*"arguments"\s*:\s*')
_QWEN_TAIL_RE = re.compile(r"\s*\}\s*")


def _parse_qwen_body(body: str) -> ToolCall | None:
    """Read ``{"name": ..., "arguments": {...}}``; None when it is not such an object."""
    obj = _json_object(body)
    if obj is None or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if not isinstance(obj.get("arguments"), dict):
        return None
    arguments = _qwen_arguments_text(body)
    if arguments is None:  # keys in another order: no single span to quote, so re-encode
        arguments = json.dumps(obj["arguments"], ensure_ascii=False)
    return ToolCall(obj["name"], arguments)


def _qwen_arguments_text(body: str) -> str | None:
    """The arguments' text as written, when the body has the usual name-then-arguments layout.

    The body is already known to be valid JSON, so matching the layout around the two values is
    enough to know the span is exactly the arguments object.
    """
    head = _QWEN_HEAD_RE.match(body)
    if head is None:
        return None
    try:
        _, pos = _DECODER.raw_decode(body, head.end())
        key = _QWEN_ARGS_KEY_RE.match(body, pos)
        if key is None:
            return None
        _, end = _DECODER.raw_decode(body, key.end())
    except ValueError:
        return None
    if _QWEN_TAIL_RE.fullmatch(body, end) is None:
        return None
    return body[key.end() : end]


_DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_DS_CALLS_END = "<｜tool▁calls▁end｜>"
_DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
_DS_CALL_END = "<｜tool▁call▁end｜>"
_DS_SEP = "<｜tool▁sep｜>"

# Body of a DeepSeek call: ``function<｜tool▁sep｜>NAME\n```json\nARGS\n```. The type word and
# the fence's language are optional, so that a near miss still counts as a call.
_DS_BODY_RE = re.compile(
    r"\s*(?:function)?\s*" + re.escape(_DS_SEP) + r"\s*(?P<name>[^\s`]+)\s*```(?:json)?(?P<args>.*?)```\s*",
    re.DOTALL,
)


def _parse_deepseek_body(body: str) -> ToolCall | None:
    """Read ``function<｜tool▁sep｜>NAME`` and the fenced JSON object; None when malformed."""
    match = _DS_BODY_RE.fullmatch(body)
    if match is None or _json_object(match["args"]) is None:
        return None
    return ToolCall(match["name"], match["args"].strip())


_FORMATS: dict[str, _Format] = {
    "deepseekv3": _Format(
        trigger=_DS_CALLS_BEGIN,
        call_begin=_DS_CALL_BEGIN,
        call_end=_DS_CALL_END,
        section_end=_DS_CALLS_END,
        separator="\n",
        call_prefix=lambda name: f"{_DS_CALL_BEGIN}function{_DS_SEP}{name}\n```json\n",
        call_suffix=f"\n```{_DS_CALL_END}",
        parse_body=_parse_deepseek_body,
    ),
    "qwen25": _Format(
        trigger="<tool_call>",
        call_begin="<tool_call>",
        call_end="</tool_call>",
        section_end=None,
        separator="\n",
        call_prefix=lambda name: '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ',
        call_suffix="}\n</tool_call>",
        parse_body=_parse_qwen_body,
    ),
}


def _format(parser: str) -> _Format:
    try:
        return _FORMATS[parser]
    except KeyError:
        raise ValueError(f"unknown tool call parser {parser!r}; known: {', '.join(PARSERS)}") from None


# --- guided decoding -------------------------------------------------------------------------


def tool_call_guide(parser: str, tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool) -> str | None:
    """The xgrammar structural tag (JSON text) that keeps the model's tool calls well-formed.

    "auto" leaves free text free until the format's trigger, after which a call to one of `tools`
    with arguments valid for its schema must follow; "required" and a named function allow only
    calls (at least one), so the reply cannot dodge the choice. Without parallel calls exactly one
    call is allowed and generation ends after it. None means nothing to constrain ("none", or
    "auto" with no tools).
    """
    fmt = _format(parser)
    if tool_choice == "none" or (tool_choice == "auto" and not tools):
        return None
    forced = tool_choice != "auto"
    calls = [_call_tag(fmt, tool) for tool in _allowed_tools(tools, tool_choice)]
    one = not parallel_tool_calls
    sequence = {
        "type": "tags_with_separator",
        "tags": calls,
        "separator": fmt.separator,
        "at_least_one": True,
        "stop_after_first": one,
    }
    if fmt.section_end is None:
        if forced:
            return _structural_tag(sequence)
        return _structural_tag(_triggered(fmt, calls, one))
    section = {"type": "tag", "begin": fmt.trigger, "content": sequence, "end": fmt.section_end}
    return _structural_tag(section if forced else _triggered(fmt, [section], one))


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


def _parameters(function: dict) -> dict:
    """The arguments schema; a function without parameters (absent or ``{}``) takes an empty object."""
    return function.get("parameters") or _NO_PARAMETERS


def _call_tag(fmt: _Format, tool: dict) -> dict:
    """One call of `tool`: its literal prefix, arguments valid against its schema, the suffix."""
    function = tool["function"]
    return {
        "type": "tag",
        "begin": fmt.call_prefix(function["name"]),
        # one whitespace character at most between tokens: a model that would pad with blank lines
        # forever cannot, and every well-formed JSON layout but pretty-printing still fits
        "content": {"type": "json_schema", "json_schema": _parameters(function), "max_whitespace_cnt": 1},
        "end": fmt.call_suffix,
    }


def _triggered(fmt: _Format, tags: list[dict], one: bool) -> dict:
    """Free text in which `fmt.trigger` starts one of `tags` (for tool_choice "auto")."""
    return {
        "type": "triggered_tags",
        "triggers": [fmt.trigger],
        "tags": tags,
        "at_least_one": False,
        "stop_after_first": one,
    }


def _structural_tag(format_: dict) -> str:
    return json.dumps({"type": "structural_tag", "format": format_}, ensure_ascii=False)


# --- parsing ---------------------------------------------------------------------------------


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
        self._fmt = _format(parser)
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
        trigger = self._fmt.trigger
        at = self._buf.find(trigger)
        if at < 0:
            keep = _partial_suffix(self._buf, trigger)
            self._add_content(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._add_content(out, self._buf[:at])
        self._held += trigger
        self._buf = self._buf[at + len(trigger) :]
        if self._fmt.section_end is None:
            self._state = _CALL
        else:
            self._state, self._section_open = _SECTION, True
        return True

    def _step_section(self, out: list[Delta]) -> bool:
        """Between DeepSeek calls: the next call, the section's end, or text that ends the section."""
        fmt = self._fmt
        assert fmt.section_end is not None  # only formats with sections get here
        start = _skip_space(self._buf, 0)
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
        fmt = self._fmt
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


# --- prompts for templates without tools -----------------------------------------------------


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
    params = _parameters(function)
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
    fmt = _format(parser)
    text = fmt.separator.join(fmt.call_prefix(c.name) + c.arguments + fmt.call_suffix for c in calls)
    if fmt.section_end is None:
        return text
    return fmt.trigger + text + fmt.section_end


# Tool results in the default rendering: DeepSeek-V3's output markers; Qwen's <tool_response>
# block (Qwen's own templates put it in a user turn, as the default rendering does).
_RESULT_WRAPPERS = {
    "deepseekv3": ("<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
    "qwen25": ("<tool_response>\n", "\n</tool_response>"),
}


def render_tool_result(parser: str, content: str) -> str:
    """A tool's result as the text of the turn that hands it back, in the parser's family format."""
    begin, end = _RESULT_WRAPPERS[parser]
    return begin + content + end


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


# --- request validation ----------------------------------------------------------------------


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
