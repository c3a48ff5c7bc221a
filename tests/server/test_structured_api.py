"""Structured outputs, tool calls and the sampling controls through the HTTP API, with the default
model: the official client (and its Pydantic parse), langchain-openai, single and AFD modes."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from afd_engine.default_model import resolve_model_path
from benchmarks.lib.structured_schemas import SCHEMAS, TOOLS, ask_schema, ask_tool_call
from tests.server.conftest import Server


@pytest.fixture(scope="module")
def default_server():
    srv = Server(str(resolve_model_path(None)))
    yield srv
    srv.stop()


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def schema_request(c: openai.OpenAI, i: int) -> tuple[dict, str]:
    schema, out = ask_schema(c, i)
    assert out.choices[0].finish_reason == "stop"
    return schema, out.choices[0].message.content


def check_schemas(srv: Server, n: int) -> None:
    c = client(srv)
    with ThreadPoolExecutor(8) as pool:
        for schema, content in pool.map(lambda i: schema_request(c, i), range(n)):
            jsonschema.validate(json.loads(content), schema)


required_tool_call = ask_tool_call


def check_tool_calls(message, finish_reason: str, parallel: bool = False) -> None:
    assert (finish_reason == "tool_calls" or parallel) and message.tool_calls
    assert parallel or len(message.tool_calls) == 1
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


def test_json_schemas_through_the_official_client(default_server):
    check_schemas(default_server, 40)


def test_pydantic_parse(default_server):
    class Book(BaseModel):
        title: str = Field(max_length=30)
        year: int = Field(ge=1800, le=2100)
        tags: list[str] = Field(max_length=3)

    out = client(default_server).beta.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "a book"}], response_format=Book, max_tokens=200
    )
    book = out.choices[0].message.parsed
    assert isinstance(book, Book) and 1800 <= book.year <= 2100


def test_json_object_in_chat_and_completions(default_server):
    c = client(default_server)
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "json"}],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
    )
    text = c.completions.create(
        model="tiny",
        prompt="Return an object",
        max_tokens=200,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    for content in (chat.choices[0].message.content, text.choices[0].text):
        assert isinstance(json.loads(content), dict), content


def test_generate_regex_ebnf_and_json_schema(default_server):
    def gen(**sp):
        resp = httpx.post(
            default_server.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 40, **sp}}
        )
        assert resp.status_code == 200, resp.text
        return resp.json()["text"]

    import re

    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", gen(regex=r"[a-z]{3}-[0-9]{2}"))
    assert gen(ebnf='root ::= "yes" | "no"') in ("yes", "no")
    out = json.loads(gen(json_schema=json.dumps(SCHEMAS[2]), max_new_tokens=60))
    assert out["color"] in ("red", "green", "blue")


def test_required_tool_calls_parse_and_validate(default_server):
    c = client(default_server)
    with ThreadPoolExecutor(5) as pool:
        for out in pool.map(lambda i: required_tool_call(c, i), range(10)):
            check_tool_calls(out.choices[0].message, out.choices[0].finish_reason)
        # parallel calls: every call it finished parses and validates
        for out in pool.map(lambda i: required_tool_call(c, i, parallel=True), range(5)):
            check_tool_calls(out.choices[0].message, out.choices[0].finish_reason, parallel=True)


def test_streamed_tool_calls_equal_the_whole_response(default_server):
    c = client(default_server)
    whole = required_tool_call(c, 3).choices[0]
    calls: dict[int, dict] = {}
    finish = content = None
    for chunk in required_tool_call(c, 3, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content = (content or "") + (choice.delta.content or "")
        for piece in choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
    assert finish == "tool_calls" and not content
    assert [calls[i] for i in sorted(calls)] == [
        {"name": t.function.name, "arguments": t.function.arguments} for t in whole.message.tool_calls
    ]


def test_a_named_tool_is_the_one_called_and_results_go_back(default_server):
    c = client(default_server)
    out = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "add"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False,
        max_tokens=120,
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "add"
    args = json.loads(call.function.arguments)
    history = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    answer = c.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "length"


def test_logit_bias_and_penalties_reach_the_sampler(default_server):
    c = client(default_server)
    out = c.completions.create(
        model="tiny", prompt="x", max_tokens=5, temperature=0, logit_bias={"300": 100}, logprobs=0
    )
    assert out.choices[0].logprobs.tokens == [out.choices[0].logprobs.tokens[0]] * 5
    gen = httpx.post(
        default_server.url + "/generate",
        json={"text": "x", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "logit_bias": {"300": 100}}},
    ).json()
    assert gen["output_ids"] == [300] * 5
    plain = c.completions.create(model="tiny", prompt="The the the", max_tokens=12, temperature=0)
    penalized = c.completions.create(
        model="tiny",
        prompt="The the the",
        max_tokens=12,
        temperature=0,
        frequency_penalty=2.0,
        presence_penalty=2.0,
        extra_body={"repetition_penalty": 1.5, "min_p": 0.1, "min_tokens": 12},
    )
    assert penalized.choices[0].text != plain.choices[0].text


@pytest.mark.parametrize(
    "patch, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "strin"}}}},
            "response_format",
            "JSON schema",
        ),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools", "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
    ],
)
def test_bad_structured_requests_are_400_naming_the_field(default_server, patch, param, words):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **patch}
    resp = httpx.post(default_server.url + "/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_a_regex_that_does_not_compile_is_400(default_server):
    resp = httpx.post(default_server.url + "/generate", json={"text": "x", "sampling_params": {"regex": "(ab"}})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "sampling_params.regex"


def test_langchain_bind_tools_and_structured_output(default_server):
    langchain_openai = pytest.importorskip("langchain_openai")

    class Answer(BaseModel):
        answer: str = Field(description="yes or no", json_schema_extra={"enum": ["yes", "no"]})
        confidence: int = Field(ge=0, le=100)

    llm = langchain_openai.ChatOpenAI(
        model="tiny", base_url=default_server.url + "/v1", api_key="x", max_tokens=120, temperature=0, max_retries=0
    )
    structured = llm.with_structured_output(Answer).invoke("Is a tuple immutable?")
    assert isinstance(structured, Answer) and structured.answer in ("yes", "no")
    reply = llm.bind_tools([t["function"] for t in TOOLS], tool_choice="any").invoke("What is the weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] in {t["function"]["name"] for t in TOOLS}


@pytest.mark.timeout(300)
def test_afd_mode(tiny_v3):
    srv = Server(
        str(resolve_model_path(None)),
        *"--mode afd --dp-size 1 --ffn-nodes 1 --ffn-ranks-per-node 1 --micro-batches 2".split(),
    )
    try:
        check_schemas(srv, 20)  # (bench_structured.py: 200 + 50 with 2 attention and 2 FFN ranks)
        c = client(srv)
        for i in range(2):
            out = required_tool_call(c, i)
            check_tool_calls(out.choices[0].message, out.choices[0].finish_reason)
    finally:
        srv.stop()


def test_n_choices_each_follow_the_schema(default_server):
    out = client(default_server).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a record"}],
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[15]}},
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=100,
        stream=True,
    )
    texts = ["", "", ""]
    for chunk in out:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[15])
