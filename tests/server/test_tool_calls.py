"""Tool calls: parsing both formats, streaming under any chunking, guides, prompts and validation."""

from __future__ import annotations

import json
import random

import pytest
import transformers
import xgrammar as xgr

from afd_engine.server.tool_calls import (
    PARSERS,
    Delta,
    ToolCall,
    ToolCallStream,
    check_tool_choice,
    check_tools,
    parse_tool_calls,
    render_tool_calls,
    template_supports_tools,
    tool_call_guide,
    tools_system_prompt,
)
from afd_engine.tiny_tokenizer import CHAT_TEMPLATE, write_tiny_tokenizer

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


def qwen_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def ds_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def ds_calls(*calls: str) -> str:
    return CALLS_BEGIN + "\n".join(calls) + CALLS_END


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
TOOLS = [WEATHER, TIME]


# --- parsing ---------------------------------------------------------------------------------

# (parser, text, expected content, expected calls)
PARSE_CASES = [
    # qwen25
    ("qwen25", "Hello there.", "Hello there.", []),
    ("qwen25", "Hello  \n", "Hello  \n", []),  # no calls: the text unchanged
    ("qwen25", "", None, []),
    ("qwen25", " \n ", None, []),
    (
        "qwen25",
        qwen_call("get_weather", '{"city": "Paris"}'),
        None,
        [ToolCall("get_weather", '{"city": "Paris"}')],
    ),
    (
        "qwen25",
        "Let me check.\n" + qwen_call("get_weather", '{"city": "Paris"}') + "\n" + qwen_call("get_time", "{}"),
        "Let me check.",
        [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", "{}")],
    ),
    (  # arguments exactly as written (spacing, number spelling), unicode untouched
        "qwen25",
        qwen_call("get_weather", '{"city":"東京 ☃",  "days" : 1e2, "x": [1,2]}'),
        None,
        [ToolCall("get_weather", '{"city":"東京 ☃",  "days" : 1e2, "x": [1,2]}')],
    ),
    (  # keys the other way round: re-encoded, non-ASCII kept as is
        "qwen25",
        '<tool_call>{"arguments": {"city": "Zürich"}, "name": "get_weather"}</tool_call>',
        None,
        [ToolCall("get_weather", '{"city": "Zürich"}')],
    ),
    (  # bad JSON stays content; the good call after it is still a call
        "qwen25",
        "A " + qwen_call("get_weather", '{"city": }') + " B\n" + qwen_call("get_time", "{}") + "\n",
        "A " + qwen_call("get_weather", '{"city": }') + " B",
        [ToolCall("get_time", "{}")],
    ),
    (  # arguments that are not an object, NaN, a missing name: content
        "qwen25",
        qwen_call("f", "[1]") + qwen_call("f", '{"a": NaN}') + '<tool_call>{"arguments": {}}</tool_call>',
        qwen_call("f", "[1]") + qwen_call("f", '{"a": NaN}') + '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    (  # an unfinished call is content
        "qwen25",
        "Sure. " + qwen_call("get_time", "{}")[:-5],
        "Sure. " + qwen_call("get_time", "{}")[:-5],
        [],
    ),
    (  # text after the calls is content; whitespace touching calls is dropped
        "qwen25",
        "Hi \n" + qwen_call("get_time", "{}") + "\n\nDone.  \n",
        "Hi\n\nDone.",
        [ToolCall("get_time", "{}")],
    ),
    ("qwen25", "a <tool_ca", "a <tool_ca", []),
    # deepseekv3
    ("deepseekv3", "Hello there.", "Hello there.", []),
    (
        "deepseekv3",
        ds_calls(ds_call("get_weather", '{"city": "Paris"}')),
        None,
        [ToolCall("get_weather", '{"city": "Paris"}')],
    ),
    (
        "deepseekv3",
        "Let me check.\n\n"
        + ds_calls(ds_call("get_weather", '{"city": "Paris", "days": 2}'), ds_call("get_time", "{}")),
        "Let me check.",
        [ToolCall("get_weather", '{"city": "Paris", "days": 2}'), ToolCall("get_time", "{}")],
    ),
    (
        "deepseekv3",
        ds_calls(ds_call("get_weather", '{"city": "東京", "note": "😀\\n"}')),
        None,
        [ToolCall("get_weather", '{"city": "東京", "note": "😀\\n"}')],
    ),
    (  # a malformed call is content, the other call survives
        "deepseekv3",
        ds_calls(ds_call("get_weather", '{"city": "Paris"'), ds_call("get_time", "{}")),
        CALLS_BEGIN + ds_call("get_weather", '{"city": "Paris"'),
        [ToolCall("get_time", "{}")],
    ),
    (  # the section is not closed yet: its finished calls count
        "deepseekv3",
        "x" + CALLS_BEGIN + ds_call("get_time", "{}") + "\n" + CALL_BEGIN + "function" + SEP + "get_w",
        "x\n" + CALL_BEGIN + "function" + SEP + "get_w",  # whitespace after a call is kept before text
        [ToolCall("get_time", "{}")],
    ),
    (  # an unfinished first call: all of it is content
        "deepseekv3",
        "x " + CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "get_time\n```json\n{}",
        "x " + CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "get_time\n```json\n{}",
        [],
    ),
    (  # a section without calls, and garbage instead of a call, are content
        "deepseekv3",
        CALLS_BEGIN + CALLS_END + " and " + CALLS_BEGIN + "oops",
        CALLS_BEGIN + CALLS_END + " and " + CALLS_BEGIN + "oops",
        [],
    ),
    (
        "deepseekv3",
        ds_calls(ds_call("get_time", "{}")) + "\nAll done.",
        "\nAll done.",
        [ToolCall("get_time", "{}")],
    ),
    ("deepseekv3", "a <｜tool▁calls", "a <｜tool▁calls", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), PARSE_CASES)
def test_parse_tool_calls(parser: str, text: str, content: str | None, calls: list[ToolCall]) -> None:
    assert parse_tool_calls(parser, text) == (content, calls)


@pytest.mark.parametrize("parser", PARSERS)
def test_render_parses_back(parser: str) -> None:
    calls = [ToolCall("get_weather", '{"city": "Zürich", "days": 3}'), ToolCall("get_time", "{}")]
    text = render_tool_calls(parser, calls)
    assert parse_tool_calls(parser, "Checking.\n" + text) == ("Checking.", calls)


def test_render_exact_text() -> None:
    calls = [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")]
    assert render_tool_calls("qwen25", calls) == qwen_call("f", '{"a": 1}') + "\n" + qwen_call("g", "{}")
    assert render_tool_calls("deepseekv3", calls) == ds_calls(ds_call("f", '{"a": 1}'), ds_call("g", "{}"))


def test_unknown_parser() -> None:
    with pytest.raises(ValueError, match="unknown tool call parser 'hermes'"):
        parse_tool_calls("hermes", "x")
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ToolCallStream("llama3")


# --- streaming -------------------------------------------------------------------------------


def stream_result(parser: str, pieces: list[str]) -> tuple[str | None, list[ToolCall]]:
    """Feed `pieces` one by one and assemble the deltas as a client would."""
    stream = ToolCallStream(parser)
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    content = ""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for d in deltas:
        if d.content is not None:
            assert d.index is None and d.name is None and d.arguments is None
            content += d.content
        elif d.name is not None:
            assert d.index == len(names) and d.index not in arguments  # names come first, in order
            names[d.index] = d.name
            arguments[d.index] = ""
        else:
            arguments[d.index] += d.arguments
    return content or None, [ToolCall(names[i], arguments[i]) for i in sorted(names)]


def chunkings(text: str, rng: random.Random) -> list[list[str]]:
    """One character at a time, every cut into two, and random cuts."""
    result = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        result.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return result


@pytest.mark.parametrize(("parser", "text", "content", "calls"), PARSE_CASES)
def test_stream_any_chunking(parser: str, text: str, content: str | None, calls: list[ToolCall]) -> None:
    rng = random.Random(text)
    for pieces in chunkings(text, rng):
        assert stream_result(parser, pieces) == (content, calls), pieces


@pytest.mark.parametrize(
    ("parser", "start", "rest"),
    [("qwen25", "<tool", "box> is here"), ("deepseekv3", "<｜tool▁call", "ing｜> is here")],
)
def test_stream_holds_back_a_possible_trigger(parser: str, start: str, rest: str) -> None:
    stream = ToolCallStream(parser)
    assert stream.feed("Hello " + start) == [Delta(content="Hello")]
    assert stream.feed(rest) == [Delta(content=" " + start + rest)]
    assert stream.finish() == []


def test_stream_holds_whitespace_until_decided() -> None:
    stream = ToolCallStream("qwen25")
    assert stream.feed("Hi \n") == [Delta(content="Hi")]
    assert stream.feed("there") == [Delta(content=" \nthere")]
    assert stream.feed(" ") == []
    assert stream.finish() == [Delta(content=" ")]  # no calls: nothing dropped


def test_stream_malformed_call_comes_back_as_one_content_delta() -> None:
    bad = qwen_call("f", "{oops}")
    stream = ToolCallStream("qwen25")
    assert stream.feed("A " + bad + " B") == [Delta(content="A " + bad + " B")]
    assert stream.finish() == []


@pytest.mark.parametrize("parser", PARSERS)
def test_stream_deltas_per_call(parser: str) -> None:
    text = "Ok.\n" + render_tool_calls(parser, [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")])
    stream = ToolCallStream(parser)
    cut = text.index("}") + 1  # inside the first call's arguments
    assert stream.feed(text[:cut]) == [Delta(content="Ok.")]
    assert stream.feed(text[cut:]) == [
        Delta(index=0, name="f"),
        Delta(index=0, arguments='{"a": 1}'),
        Delta(index=1, name="g"),
        Delta(index=1, arguments="{}"),
    ]
    assert stream.finish() == []


# --- guides ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> tuple[xgr.GrammarCompiler, int]:
    """A grammar compiler over the tiny byte-level tokenizer, and its eos id."""
    path = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    return xgr.GrammarCompiler(info), tokenizer.eos_token_id


def accepts(compiler: tuple[xgr.GrammarCompiler, int], guide: str, text: str) -> bool:
    """Whether the guide allows `text` as a whole reply (the reply may end right after it)."""
    grammar_compiler, eos = compiler
    matcher = xgr.GrammarMatcher(grammar_compiler.compile_structural_tag(guide))
    if not matcher.accept_string(text) or not matcher.accept_token(eos):
        return False
    return matcher.is_terminated()


def render(parser: str, *calls: tuple[str, str]) -> str:
    return render_tool_calls(parser, [ToolCall(name, arguments) for name, arguments in calls])


PARIS = ("get_weather", '{"city": "Paris", "days": 2}')
NOW = ("get_time", "{}")


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_guide_compiles(parser: str, choice: str | dict, parallel: bool) -> None:
    guide = tool_call_guide(parser, TOOLS, choice, parallel)
    assert json.loads(guide)["type"] == "structural_tag"
    xgr.Grammar.from_structural_tag(guide)


@pytest.mark.parametrize("parser", PARSERS)
def test_guide_none(parser: str) -> None:
    assert tool_call_guide(parser, TOOLS, "none", True) is None
    assert tool_call_guide(parser, [], "auto", True) is None
    with pytest.raises(ValueError, match="needs at least one tool"):
        tool_call_guide(parser, [], "required", True)
    with pytest.raises(ValueError, match="tool_choice.function.name 'nope' is not one of the tools"):
        tool_call_guide(parser, TOOLS, {"type": "function", "function": {"name": "nope"}}, True)


@pytest.mark.parametrize("parser", PARSERS)
def test_guide_auto(compiler, parser: str) -> None:
    guide = tool_call_guide(parser, TOOLS, "auto", True)
    assert accepts(compiler, guide, "Just text, no calls.")
    assert accepts(compiler, guide, "Let me look.\n" + render(parser, PARIS))
    assert accepts(compiler, guide, render(parser, PARIS, NOW))
    assert not accepts(compiler, guide, "Hi " + render(parser, ("get_stock", "{}")))  # unknown tool
    assert not accepts(compiler, guide, render(parser, ("get_weather", '{"city": 3}')))  # wrong type
    assert not accepts(compiler, guide, render(parser, ("get_weather", '{"days": 3}')))  # required field
    assert not accepts(compiler, guide, render(parser, ("get_time", '{"x": 1}')))  # no parameters


@pytest.mark.parametrize("parser", PARSERS)
def test_guide_required(compiler, parser: str) -> None:
    guide = tool_call_guide(parser, TOOLS, "required", True)
    assert accepts(compiler, guide, render(parser, PARIS))
    assert accepts(compiler, guide, render(parser, PARIS, NOW))
    assert not accepts(compiler, guide, "Let me look.\n" + render(parser, PARIS))  # free text
    assert not accepts(compiler, guide, "Just text.")
    assert not accepts(compiler, guide, "")  # at least one call
    assert not accepts(compiler, guide, render(parser, PARIS) + "\nDone.")


@pytest.mark.parametrize("parser", PARSERS)
def test_guide_named(compiler, parser: str) -> None:
    guide = tool_call_guide(parser, TOOLS, {"type": "function", "function": {"name": "get_time"}}, True)
    assert accepts(compiler, guide, render(parser, NOW))
    assert not accepts(compiler, guide, render(parser, PARIS))
    assert not accepts(compiler, guide, "Now: " + render(parser, NOW))


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_guide_single_call(compiler, parser: str, choice: str) -> None:
    guide = tool_call_guide(parser, TOOLS, choice, False)
    assert accepts(compiler, guide, render(parser, PARIS))
    assert not accepts(compiler, guide, render(parser, PARIS, NOW))
    parallel = tool_call_guide(parser, TOOLS, choice, True)
    assert accepts(compiler, parallel, render(parser, PARIS, NOW))


# --- prompts ---------------------------------------------------------------------------------


def test_template_supports_tools() -> None:
    assert not template_supports_tools(None)
    assert not template_supports_tools(CHAT_TEMPLATE)
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")


def test_tools_system_prompt_qwen() -> None:
    prompt = tools_system_prompt("qwen25", TOOLS + [ENUMS])
    assert prompt == (
        "You may call these functions:\n"
        "get_weather(city: string, days?: integer) - Current weather of a city.\n"
        "get_time()\n"
        'pick(mode: "a"|"b", ids?: integer[], kind?: "x")\n'
        "To call one, reply with:\n"
        '<tool_call>\n{"name": "<name>", "arguments": <arguments as a JSON object>}\n</tool_call>'
    )


def test_tools_system_prompt_deepseek() -> None:
    prompt = tools_system_prompt("deepseekv3", [TIME])
    assert "get_time()\n" in prompt and "get_weather" not in prompt
    assert prompt.endswith(
        f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}<name>\n```json\n<arguments as a JSON object>\n```{CALL_END}{CALLS_END}"
    )


ENUMS = {
    "type": "function",
    "function": dict(
        name="pick",
        parameters={
            "type": "object",
            "properties": {
                "mode": {"enum": ["a", "b"]},
                "ids": {"type": "array", "items": {"type": "integer"}},
                "kind": {"const": "x"},
            },
            "required": ["mode"],
        },
    ),
}


# --- validation ------------------------------------------------------------------------------


def test_check_tools_accepts() -> None:
    assert check_tools(TOOLS) is TOOLS
    assert check_tools([]) == []


def function(**fields) -> dict:
    return {"type": "function", "function": fields}


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ({"type": "function"}, "tools must be a list"),
        ([TIME, "get_time"], "tools[1] must be an object"),
        ([{"type": "tool", "function": {"name": "f"}}], "tools[0].type must be 'function'"),
        ([{"type": "function"}], "tools[0].function is required"),
        ([{"type": "function", "function": "f"}], "tools[0].function must be an object"),
        ([TIME, function(description="x")], "tools[1].function.name is required"),
        ([function(name="")], "tools[0].function.name is required"),
        ([function(name=7)], "tools[0].function.name must be a string"),
        ([function(name="get time")], "tools[0].function.name 'get time' must match ^[a-zA-Z0-9_-]{1,64}$"),
        ([function(name="f" * 65)], f"tools[0].function.name '{'f' * 65}' must match ^[a-zA-Z0-9_-]{{1,64}}$"),
        ([function(name="f", description=1)], "tools[0].function.description must be a string"),
        ([function(name="f", strict="yes")], "tools[0].function.strict must be a boolean"),
        ([function(name="f", parameters=[])], "tools[0].function.parameters must be an object"),
        (
            [TIME, function(name="f", parameters={"type": "wat"})],
            'tools[1].function.parameters is not a usable JSON schema: Unsupported type "wat"',
        ),
        ([TIME, WEATHER, TIME], "tools[2].function.name 'get_time' is used by an earlier tool"),
    ],
)
def test_check_tools_errors(tools: object, message: str) -> None:
    with pytest.raises(ValueError) as error:
        check_tools(tools)
    assert str(error.value) == message


def test_check_tool_choice() -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    assert check_tool_choice(None, TOOLS) == "auto"
    assert check_tool_choice(None, None) == "none"
    assert check_tool_choice("none", TOOLS) == "none"
    assert check_tool_choice("auto", []) == "auto"
    assert check_tool_choice("required", TOOLS) == "required"
    assert check_tool_choice(named, TOOLS) is named


@pytest.mark.parametrize(
    ("choice", "tools", "message"),
    [
        ("any", TOOLS, "tool_choice must be one of none, auto, required or a named function"),
        (3, TOOLS, "tool_choice must be a string or an object"),
        ("required", [], "tool_choice 'required' needs at least one tool in tools"),
        ({"type": "tool", "function": {"name": "get_time"}}, TOOLS, "tool_choice.type must be 'function'"),
        ({"type": "function"}, TOOLS, "tool_choice.function must be an object"),
        ({"type": "function", "function": {}}, TOOLS, "tool_choice.function.name is required"),
        (
            {"type": "function", "function": {"name": "get_time"}},
            None,
            "tool_choice.function.name 'get_time' is not one of the tools",
        ),
        (
            {"type": "function", "function": {"name": "get_stock"}},
            TOOLS,
            "tool_choice.function.name 'get_stock' is not one of the tools",
        ),
    ],
)
def test_check_tool_choice_errors(choice: object, tools: list[dict] | None, message: str) -> None:
    with pytest.raises(ValueError) as error:
        check_tool_choice(choice, tools)
    assert str(error.value) == message


# --- rendering through the server's chat route -------------------------------------------------


class RecordingTokenizer:
    """Stands in for a tokenizer: records what the chat template would be given."""

    def __init__(self, chat_template: str) -> None:
        self.chat_template, self.seen = chat_template, None

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs):
        self.seen = (messages, kwargs)
        return {"input_ids": [7, 8]}


def render_chat(chat_template: str, body: dict) -> tuple[list, dict]:
    import asyncio
    import types

    from afd_engine.server.api_server import _render_chat
    from afd_engine.server.protocol import ChatCompletionRequest

    tok = RecordingTokenizer(chat_template)
    state = types.SimpleNamespace(tokenizer=tok, tool_call_parser="qwen25")
    assert asyncio.run(_render_chat(state, ChatCompletionRequest.model_validate(body))) == [7, 8]
    return tok.seen


HISTORY = {
    "model": "m",
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ],
}


def test_a_template_that_renders_tools_gets_them_and_the_history_as_is():
    messages, kwargs = render_chat("{% for tool in tools %}{{ tool }}{% endfor %}", HISTORY)
    assert kwargs == {"tools": TOOLS}
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert messages[2] == {"role": "tool", "content": "noon", "tool_call_id": "c1"}


def test_a_template_without_tools_gets_the_default_rendering():
    messages, kwargs = render_chat("{{ messages }}", HISTORY)
    assert kwargs == {}
    assert messages[0] == {"role": "system", "content": tools_system_prompt("qwen25", TOOLS)}
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    }
    assert messages[3] == {"role": "user", "content": "<tool_response>\nnoon\n</tool_response>"}
    none, _ = render_chat("{{ messages }}", {**HISTORY, "tool_choice": "none"})
    assert none[0]["role"] == "user"  # tools not offered: no tools message, the history still rewritten
