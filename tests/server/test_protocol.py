"""Request validation, the mapping onto SamplingParams, error bodies, and response shapes.

Response JSON is checked against the official ``openai`` package's types where installed, so the
field names and nulls are what real OpenAI clients parse.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from pydantic import ValidationError

from afd_engine.errors import InvalidRequestError
from afd_engine.sampling_params import SamplingParams
from afd_engine.server import errors
from afd_engine.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    GenerateRequest,
    LogprobFormatter,
    ModelCard,
    ModelList,
    UsageInfo,
    sampling_params_for_choice,
    sse_event,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}]}


def error_of(cls, body) -> tuple[int, dict]:
    """Validate a JSON body the way the server does; return (status, error object) of the 400."""
    with pytest.raises(ValidationError) as info:
        cls.model_validate_json(json.dumps(body))
    response = errors.validation_error_response(info.value)
    return response.status_code, json.loads(response.body)["error"]


# --- valid requests ----------------------------------------------------------------------------


def test_chat_request_parses_and_ignores_unknown_fields():
    req = ChatCompletionRequest.model_validate_json(
        json.dumps(
            {
                **CHAT,
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "developer", "content": None},
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                ],
                "max_tokens": 7,
                "temperature": 1,
                "top_p": 0.9,
                "top_k": 40,
                "seed": 3,
                "stop": "\n",
                "n": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
                "logprobs": True,
                "top_logprobs": 2,
                "presence_penalty": 0,
                "frequency_penalty": 0.0,
                "user": "u1",
                "ignore_eos": True,
                "tools": [],
                "response_format": {"type": "text"},
                "parallel_tool_calls": False,  # ignored
            }
        )
    )
    assert req.temperature == 1.0 and isinstance(req.temperature, float)
    assert req.stop == ["\n"] and req.n == 2 and req.include_usage
    assert req.messages[2].content == "a\nb"
    assert req.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": ""},
        {"role": "user", "content": "a\nb"},
    ]


def test_null_means_default():
    # The OpenAI spec marks these nullable, and some clients send explicit nulls.
    req = ChatCompletionRequest.model_validate_json(
        json.dumps(
            {
                **CHAT,
                "n": None,
                "stream": None,
                "logprobs": None,
                "top_logprobs": None,
                "temperature": None,
                "stop": None,
                "stream_options": None,
                "max_tokens": None,
                "presence_penalty": None,
            }
        )
    )
    assert req.n == 1 and req.stream is False and req.logprobs is False and req.stop is None
    assert (
        GenerateRequest.model_validate({"text": "a", "input_ids": None, "sampling_params": {"seed": None}}).text == "a"
    )
    _, err = error_of(ChatCompletionRequest, {**CHAT, "model": None})
    assert err["param"] == "model"


def test_huge_max_tokens_is_left_to_the_server():
    # The schema cannot know the context length; the server checks prompt + max_tokens later.
    assert ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 10**9}).max_tokens == 10**9


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    req = CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": prompt, "logprobs": 2}))
    assert req.prompts() == expected


def test_generate_request_parses():
    req = GenerateRequest.model_validate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "stop": "x"}})
    assert req.input_ids == [1, 2] and req.text is None and req.sampling_params.stop == ["x"]
    assert GenerateRequest.model_validate({"text": "hi", "stream": True}).stream


# --- invalid requests: 400 naming the field ---------------------------------------------------


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"messages": "Hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"model": 3}, "model"),
    ],
)
def test_chat_invalid(patch, param):
    status, err = error_of(ChatCompletionRequest, {**CHAT, **patch})
    assert status == 400
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"] is None
    # Readable: names the field, no Python reprs or pydantic links.
    assert f"'{param}'" in err["message"] and "pydantic" not in err["message"] and "\n" not in err["message"]


def test_error_messages_read_well():
    _, err = error_of(ChatCompletionRequest, {**CHAT, "max_tokens": "5"})
    assert err["message"] == "Invalid value for 'max_tokens': Input should be a valid integer (got \"5\")."
    _, err = error_of(ChatCompletionRequest, {"messages": CHAT["messages"]})
    assert err["param"] == "model" and err["message"] == "Missing required parameter: 'model'."
    _, err = error_of(ChatCompletionRequest, {**CHAT, "audio": {"voice": "alloy"}})
    assert "not supported" in err["message"]
    _, err = error_of(ChatCompletionRequest, [1, 2])
    assert err["param"] is None and err["message"].startswith("Invalid request body")


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": 1}, "echo"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "echo": True}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
    ],
)
def test_completion_invalid(patch, param):
    status, err = error_of(CompletionRequest, {"model": "m", "prompt": "hi", **patch})
    assert status == 400 and err["param"] == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input_ids"),
        ({"text": "a", "input_ids": [1]}, "input_ids"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, -2]}, "input_ids[1]"),
        ({"text": "a", "sampling_params": {"max_tokens": 4}}, "sampling_params.max_tokens"),  # typo caught
        ({"text": "a", "sampling_params": {"max_new_tokens": "4"}}, "sampling_params.max_new_tokens"),
        ({"text": "a", "sampling_params": {"stop_token_ids": [-1]}}, "sampling_params.stop_token_ids[0]"),
    ],
)
def test_generate_invalid(body, param):
    status, err = error_of(GenerateRequest, body)
    assert status == 400 and err["param"] == param


# --- mapping onto SamplingParams ---------------------------------------------------------------


def test_chat_sampling_params():
    req = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "max_tokens": 9,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 5,
            "seed": 11,
            "stop": ["x", "yz"],
            "ignore_eos": True,
        }
    )
    sp = req.to_sampling_params(default_max_tokens=100)
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (9, 0.0, 0.5, 5, 11)
    assert sp.stop == ("x", "yz") and sp.ignore_eos and sp.greedy


def test_defaults_and_max_completion_tokens():
    sp = ChatCompletionRequest.model_validate(CHAT).to_sampling_params(default_max_tokens=77)
    default = SamplingParams()
    assert sp.max_new_tokens == 77 and sp.temperature == default.temperature and sp.top_p == default.top_p
    assert sp.seed is None and sp.stop == () and not sp.ignore_eos
    req = ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 5, "max_completion_tokens": 6})
    assert req.to_sampling_params(100).max_new_tokens == 6


def test_seed_per_choice():
    req = ChatCompletionRequest.model_validate({**CHAT, "seed": 41, "n": 3})
    assert [p.seed for p in req.choice_sampling_params(16)] == [41, 42, 43]
    assert [p.seed for p in ChatCompletionRequest.model_validate({**CHAT, "n": 2}).choice_sampling_params(16)] == [
        None,
        None,
    ]
    top = SamplingParams(seed=2**63 - 1)
    assert sampling_params_for_choice(top, 1).seed == 0  # wraps instead of overflowing int64
    assert sampling_params_for_choice(top, 0) is top


def test_sampling_params_error_propagates():
    # The schema allows a temperature above 2 for /generate; SamplingParams rejects > 100.
    req = GenerateRequest.model_validate({"text": "a", "sampling_params": {"temperature": 150}})
    with pytest.raises(InvalidRequestError) as info:
        req.to_sampling_params(16)
    assert info.value.param == "temperature"
    with pytest.raises(InvalidRequestError) as info:
        ChatCompletionRequest.model_validate(CHAT).to_sampling_params(default_max_tokens=0)
    assert info.value.param == "max_new_tokens"


def test_generate_sampling_params():
    req = GenerateRequest.model_validate(
        {
            "input_ids": [5],
            "sampling_params": {
                "max_new_tokens": 3,
                "temperature": 0.7,
                "stop": ["</s>"],
                "stop_token_ids": [7, 8],
                "ignore_eos": True,
                "include_stop_str_in_output": True,
                "skip_special_tokens": False,
                "seed": 1,
            },
        }
    )
    sp = req.to_sampling_params(100)
    assert (sp.max_new_tokens, sp.temperature, sp.stop, sp.stop_token_ids, sp.seed) == (3, 0.7, ("</s>",), (7, 8), 1)
    assert sp.ignore_eos and sp.include_stop_str_in_output and not sp.skip_special_tokens
    assert GenerateRequest.model_validate({"text": "a"}).to_sampling_params(12).max_new_tokens == 12


def test_logprobs_mapping():
    chat = ChatCompletionRequest.model_validate
    assert chat(CHAT).to_sampling_params(8).logprobs is None
    assert chat({**CHAT, "logprobs": True}).to_sampling_params(8).logprobs == 0
    assert chat({**CHAT, "logprobs": True, "top_logprobs": 4}).to_sampling_params(8).logprobs == 4
    comp = CompletionRequest.model_validate
    assert comp({"model": "m", "prompt": "a"}).to_sampling_params(8).logprobs is None
    assert comp({"model": "m", "prompt": "a", "logprobs": 0}).to_sampling_params(8).logprobs == 0
    assert comp({"model": "m", "prompt": "a", "logprobs": 5}).to_sampling_params(8).logprobs == 5


# --- error responses ---------------------------------------------------------------------------


def body_of(response) -> dict:
    return json.loads(response.body)


def test_error_bodies():
    r = errors.openai_error(418, "short and stout", type="teapot", param="p", code="c")
    assert r.status_code == 418
    assert body_of(r) == {"error": {"message": "short and stout", "type": "teapot", "param": "p", "code": "c"}}

    r = errors.invalid_request_response(InvalidRequestError("bad top_p", param="top_p"))
    assert r.status_code == 400 and body_of(r)["error"] == {
        "message": "bad top_p",
        "type": "invalid_request_error",
        "param": "top_p",
        "code": None,
    }

    too_long = InvalidRequestError("the prompt has 900 tokens but the context length is 512; shorten it")
    r = errors.invalid_request_response(too_long)
    assert r.status_code == 400 and body_of(r)["error"]["code"] == "context_length_exceeded"

    r = errors.model_not_found("gpt-9")
    assert r.status_code == 404 and body_of(r)["error"]["code"] == "model_not_found"
    assert body_of(r)["error"]["type"] == "invalid_request_error" and "gpt-9" in body_of(r)["error"]["message"]

    r = errors.invalid_api_key()
    assert r.status_code == 401 and body_of(r)["error"]["code"] == "invalid_api_key"
    assert body_of(r)["error"]["type"] == "invalid_request_error"


def _asgi_post(app, path: str, raw: bytes) -> tuple[int, dict]:
    """POST through the ASGI interface (no HTTP client needed)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


def test_fastapi_handlers():
    from fastapi import FastAPI

    app = FastAPI()
    errors.install_exception_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        req.to_sampling_params(default_max_tokens=0)  # raises InvalidRequestError
        return {}

    @app.post("/missing")
    async def missing():
        raise errors.APIError(404, "nope", code="model_not_found", param="model")

    status, body = _asgi_post(app, "/v1/chat/completions", json.dumps({**CHAT, "max_tokens": "5"}).encode())
    assert (
        status == 400
        and body["error"]["param"] == "max_tokens"
        and set(body["error"]) == {"message", "type", "param", "code"}
    )
    status, body = _asgi_post(app, "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["param"] is None and "JSON" in body["error"]["message"]
    status, body = _asgi_post(app, "/v1/chat/completions", json.dumps(CHAT).encode())
    assert status == 400 and body["error"]["param"] == "max_new_tokens"
    status, body = _asgi_post(app, "/missing", b"")
    assert status == 404 and body["error"] == {
        "message": "nope",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


# --- responses ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from afd_engine.tiny_tokenizer import write_tiny_tokenizer

    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def test_chat_response_json(tokenizer):
    openai = pytest.importorskip("openai")
    fmt = LogprobFormatter(tokenizer)
    ids = tokenizer.encode(" price 世", add_special_tokens=False)
    lps = [-0.5] * len(ids)
    top = [([i, 44], [-0.5, float("-inf")]) for i in ids]
    resp = ChatCompletionResponse(
        model="m",
        choices=[
            ChatCompletionChoice(
                index=0,
                message=ChatResponseMessage(content="hi"),
                finish_reason="stop",
                logprobs=fmt.chat_logprobs(ids, lps, top),
            ),
            ChatCompletionChoice(index=1, message=ChatResponseMessage(content="yo"), finish_reason="length"),
        ],
        usage=UsageInfo.of(3, 4),
    )
    raw = resp.model_dump_json()
    data = json.loads(raw)
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    assert data["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert "logprobs" in data["choices"][1] and data["choices"][1]["logprobs"] is None
    parsed = openai.types.chat.ChatCompletion.model_validate_json(raw)
    content = parsed.choices[0].logprobs.content
    assert [c.logprob for c in content] == lps and content[0].top_logprobs[1].logprob == -9999.0
    # The bytes of the tokens spell the text exactly, even where a token is part of a character.
    assert b"".join(bytes(c.bytes) for c in content).decode() == " price 世"
    assert content[-1].token.startswith("bytes:\\x")


def test_chat_chunks_json():
    openai = pytest.importorskip("openai")
    first = ChatCompletionChunk(
        id="chatcmpl-1",
        model="m",
        choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))],
    )
    middle = ChatCompletionChunk(
        id="chatcmpl-1", model="m", choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="Hel"))]
    )
    last = ChatCompletionChunk(
        id="chatcmpl-1",
        model="m",
        choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(), finish_reason="stop")],
    )
    usage = ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[], usage=UsageInfo.of(1, 2))
    docs = [json.loads(c.model_dump_json()) for c in (first, middle, last, usage)]
    assert docs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert docs[1]["choices"][0] == {"index": 0, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}
    assert docs[2]["choices"][0]["delta"] == {} and docs[2]["choices"][0]["finish_reason"] == "stop"
    assert docs[1]["usage"] is None and docs[3]["usage"]["total_tokens"] == 3 and docs[3]["choices"] == []
    assert all(d["object"] == "chat.completion.chunk" for d in docs)
    for c in (first, middle, last, usage):
        openai.types.chat.ChatCompletionChunk.model_validate_json(c.model_dump_json())
    event = sse_event(middle)
    assert event.startswith("data: {") and event.endswith("}\n\n")


def test_completion_json(tokenizer):
    openai = pytest.importorskip("openai")
    fmt = LogprobFormatter(tokenizer)
    text = "ok 世界 ok"
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    lps = [-1.0] * len(ids)
    top = [([ids[0]], [-0.25])] * len(ids)
    logprobs = fmt.completion_logprobs(ids, lps, top, text_offset=10)
    resp = CompletionResponse(
        model="m",
        choices=[CompletionChoice(index=0, text=text, finish_reason="stop", logprobs=logprobs)],
        usage=UsageInfo.of(2, len(ids)),
    )
    parsed = openai.types.Completion.model_validate_json(resp.model_dump_json())
    lp = parsed.choices[0].logprobs
    assert lp.token_logprobs == lps and len(lp.tokens) == len(ids) == len(lp.text_offset) == len(lp.top_logprobs)
    # Offsets are character positions in the text, here starting at 10; the skipped EOS adds none.
    assert lp.text_offset[0] == 10 and lp.text_offset[-1] == 10 + len(text)
    assert all(text[o - 10] == text[lp.text_offset[i] - 10] for i, o in enumerate(lp.text_offset[:-1]))
    assert lp.text_offset[3] == 10 + text.index("世")
    # Each dict holds the alternatives and the chosen token.
    assert lp.top_logprobs[1] == {lp.tokens[0]: -0.25, lp.tokens[1]: -1.0}
    assert lp.tokens[-1] == tokenizer.eos_token

    chunk = CompletionChunk(id="cmpl-1", model="m", choices=[CompletionChoice(index=0, text="ok")])
    data = json.loads(chunk.model_dump_json())
    assert data["object"] == "text_completion" and data["usage"] is None
    assert data["choices"][0] == {"index": 0, "text": "ok", "logprobs": None, "finish_reason": None}
    done = CompletionChunk(id="cmpl-1", model="m", choices=[CompletionChoice(index=0, text="", finish_reason="length")])
    openai.types.Completion.model_validate_json(done.model_dump_json())


def test_model_list_json():
    openai = pytest.importorskip("openai")
    data = json.loads(ModelList(data=[ModelCard(id="deepseek-v3")]).model_dump_json())
    assert data["object"] == "list" and data["data"][0]["owned_by"]
    card = openai.types.Model.model_validate(data["data"][0])
    assert card.id == "deepseek-v3" and card.object == "model" and isinstance(card.created, int)


def test_logprob_edge_values(tokenizer):
    fmt = LogprobFormatter(tokenizer)
    out = fmt.chat_logprobs([44], [float("nan")], None)
    assert out.content[0].logprob == -9999.0 and out.content[0].top_logprobs == []
    assert math.isfinite(json.loads(out.model_dump_json())["content"][0]["logprob"])
    legacy = fmt.completion_logprobs([44, 44], [-1.0, -2.0])
    assert legacy.top_logprobs is None and legacy.text_offset == [0, 1]


def test_unset_sampling_fields_take_the_models_generation_config(tmp_path):
    from afd_engine.default_model import default_model_path
    from afd_engine.server.protocol import generation_defaults

    defaults = generation_defaults(default_model_path())
    assert defaults == {"temperature": 0.7, "top_p": 0.9}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    sp = ChatCompletionRequest.model_validate(chat).to_sampling_params(16, defaults)
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.7, 0.9, -1)
    sp = ChatCompletionRequest.model_validate({**chat, "temperature": 0}).to_sampling_params(16, defaults)
    assert (sp.temperature, sp.top_p) == (0.0, 0.9)  # what the request sets wins
    native = GenerateRequest.model_validate({"input_ids": [1], "sampling_params": {"top_p": 0.5}})
    assert (native.to_sampling_params(16, defaults).temperature, native.to_sampling_params(16, defaults).top_p) == (
        0.7,
        0.5,
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.3}))
    assert generation_defaults(tmp_path) == {}  # greedy-by-default configs impose nothing
    assert generation_defaults(tmp_path / "missing") == {}
