"""The API boundary under hostile input, against a real `afd serve`.

Invalid Unicode, oversized and malformed bodies, unsupported fields and roles: each is refused
with the exact status and OpenAI's error JSON naming the field, the OpenAPI document says so, and
afterwards the server is healthy and gives the same greedy text as before.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema_rs
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from afd_engine.cli import build_parser
from afd_engine.errors import ConfigError
from afd_engine.server.serve import ServerArgs
from tests.server.conftest import Server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
USER_HI = [{"role": "user", "content": "hi"}]
OK_BODY = {
    CHAT: {"model": "tiny", "messages": USER_HI, "max_tokens": 2},
    COMPLETIONS: {"model": "tiny", "prompt": "hi", "max_tokens": 2},
    GENERATE: {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
}
DEFAULTS = ServerArgs()


def post(server, path: str, body, **headers) -> httpx.Response:
    """POST ``body`` as JSON with ASCII escapes, so a lone surrogate travels as ``"\\ud800"``
    (legal JSON) instead of failing to encode on the client."""
    raw = json.dumps(body) if isinstance(body, (dict, list)) else body
    return httpx.post(
        server.url + path, content=raw, timeout=120, headers={"content-type": "application/json", **headers}
    )


def assert_error(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text[:500]
    assert resp.headers["content-type"] == "application/json"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    return err


def greedy_texts(server) -> list:
    chat = post(
        server,
        CHAT,
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Tell me"}],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    comp = post(
        server, COMPLETIONS, {"model": "tiny", "prompt": "Once", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    )
    gen = post(
        server,
        GENERATE,
        {"text": "Once", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}},
    )
    assert [r.status_code for r in (chat, comp, gen)] == [200, 200, 200]
    return [chat.json()["choices"][0]["message"]["content"], comp.json()["choices"][0]["text"], gen.json()["text"]]


@pytest.fixture(scope="module", autouse=True)
def baseline(server) -> list:
    """The greedy texts before any malformed request (autouse: computed before the first test)."""
    return greedy_texts(server)


# --- 1. invalid Unicode, named by field --------------------------------------------------------

LONE = "\ud800"
CHAT_UNICODE = [
    ({"messages": [{"role": "user", "content": "a" + LONE}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages[0].content"),
    ({"messages": [*USER_HI, {"role": "user", "content": "x", "name": LONE}]}, "messages[1].name"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": LONE}]}, "messages[0].tool_call_id"),
    ({"stop": LONE}, "stop"),
    ({"stop": ["fine", "\udc00z"]}, "stop"),
    ({"model": LONE}, "model"),
    ({"user": LONE}, "user"),
    ({"max_tokens": LONE}, "max_tokens"),  # a type error whose message quotes the surrogate
]
COMPLETION_UNICODE = [
    ({"prompt": LONE}, "prompt"),
    ({"prompt": ["fine", LONE]}, "prompt"),
    ({"stop": [LONE]}, "stop"),
]
GENERATE_UNICODE = [
    ({"text": "x" + LONE}, "text"),
    ({"sampling_params": {"max_new_tokens": 2, "stop": [LONE]}}, "sampling_params.stop"),
]


@pytest.mark.parametrize(
    "path, patch, param",
    [(CHAT, *c) for c in CHAT_UNICODE]
    + [(COMPLETIONS, *c) for c in COMPLETION_UNICODE]
    + [(GENERATE, *c) for c in GENERATE_UNICODE],
)
def test_lone_surrogates_are_400_naming_the_field(server, path, patch, param):
    err = assert_error(post(server, path, {**OK_BODY[path], **patch}), 400, param)
    assert "\\ud800" in err["message"] if patch.get("max_tokens") else "not valid Unicode" in err["message"]


def test_a_surrogate_pair_escape_is_a_valid_character(server):
    # "\ud83d\ude00" in JSON is one character (U+1F600), which must pass untouched.
    raw = '{"model": "tiny", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2, "stop": ["\\ud83d\\ude00"]}'
    assert post(server, COMPLETIONS, raw).status_code == 200


# --- 2. limits -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, patch, param, words",
    [
        (GENERATE, {"sampling_params": {"stop": [str(i) for i in range(17)]}}, "sampling_params.stop", "at most 16"),
        (GENERATE, {"sampling_params": {"stop": "x" * 1001}}, "sampling_params.stop", "at most 1000 characters"),
        (CHAT, {"stop": ["x" * 1001]}, "stop", "at most 1000 characters"),
        (CHAT, {"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        (COMPLETIONS, {"prompt": "a" * (DEFAULTS.max_prompt_chars + 1)}, "prompt", "--max-prompt-chars"),
        (COMPLETIONS, {"prompt": ["a" * (DEFAULTS.max_prompt_chars // 2)] * 2 + ["b"]}, "prompt", "--max-prompt-chars"),
        (
            CHAT,
            {"messages": [{"role": "system", "content": "s" * DEFAULTS.max_prompt_chars}, *USER_HI]},
            "messages",
            "--max-prompt-chars",
        ),
        (GENERATE, {"text": "t" * (DEFAULTS.max_prompt_chars + 1)}, "text", "--max-prompt-chars"),
    ],
)
def test_limits_are_400_naming_the_field(server, path, patch, param, words):
    assert words in assert_error(post(server, path, {**OK_BODY[path], **patch}), 400, param)["message"]


def test_stop_strings_up_to_the_limits_are_accepted(server):
    stop = [f"{i}" * 1000 for i in range(10)] + list("abcdef")  # 16 strings, 10 of them 1000 characters long
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop": stop}}
    assert post(server, GENERATE, body).status_code == 200


def test_a_body_over_the_byte_limit_is_413_before_parsing(server):
    over = DEFAULTS.max_request_bytes + 1
    # not even JSON: the limit is checked before anything parses it
    err = assert_error(post(server, COMPLETIONS, b"x" * over), 413, None)
    assert err["code"] == "request_too_large" and "--max-request-bytes" in err["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(over // 2**20 + 1):
            yield b"x" * 2**20

    assert_error(post(server, COMPLETIONS, chunks()), 413, None)


def test_server_flags_reach_server_args():
    ns = build_parser().parse_args(["serve", "--max-request-bytes", "2000", "--max-prompt-chars", "50"])
    args = ServerArgs.from_cli(ns)
    assert (args.max_request_bytes, args.max_prompt_chars) == (2000, 50)
    assert ServerArgs.from_cli(build_parser().parse_args(["serve"])) == DEFAULTS
    with pytest.raises(ConfigError, match="--max-request-bytes=0"):
        ServerArgs(max_request_bytes=0)


def test_the_limit_flags_take_effect(tiny_v3):
    srv = Server(tiny_v3, "--max-request-bytes", "2000", "--max-prompt-chars", "50")
    try:
        assert_error(post(srv, GENERATE, {"text": "a" * 2000}), 413, None)
        assert_error(post(srv, GENERATE, {"text": "a" * 51}), 400, "text")
        assert post(srv, GENERATE, {"text": "a" * 50, "sampling_params": {"max_new_tokens": 1}}).status_code == 200
    finally:
        srv.stop()


# --- 3. tokenization off the event loop ------------------------------------------------------------


def test_a_huge_prompt_does_not_stall_other_clients(server):
    prompt = ("the quick brown fox jumps over a lazy dog " * 30000)[: DEFAULTS.max_prompt_chars]
    latencies: list[float] = []
    done = threading.Event()

    def poll_health():
        while not done.is_set():
            t = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            latencies.append(time.monotonic() - t)
            time.sleep(0.01)

    poller = threading.Thread(target=poll_health)
    poller.start()
    time.sleep(0.1)
    start = time.monotonic()
    resp = post(server, COMPLETIONS, {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    took = time.monotonic() - start
    done.set()
    poller.join()
    assert_error(resp, 400, "max_tokens")  # tokenized, then longer than the context
    assert took > 0.3, "the prompt tokenized too fast for this test to tell anything"
    # On the event loop, one health check would wait for the whole tokenization.
    assert max(latencies) < took / 2, (max(latencies), took)
    assert len(latencies) >= 3


# --- 4. chat roles ------------------------------------------------------------------------------


def test_developer_is_the_system_role(server):
    def reply(role):
        body = {
            "model": "tiny",
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        }
        resp = post(server, CHAT, body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["message"]["content"], resp.json()["usage"]["prompt_tokens"]

    assert reply("developer") == reply("system")


def test_a_tool_result_goes_through_the_default_rendering(server, tiny_v3):
    """The tiny template knows no "tool" role (it raises on it); the server writes the result as a
    user turn in the deepseekv3 format instead of failing."""
    from transformers import AutoTokenizer

    tool = {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    resp = post(server, CHAT, {**OK_BODY[CHAT], "messages": [*USER_HI, tool]})
    assert resp.status_code == 200, resp.text
    result = {"role": "user", "content": "<｜tool▁output▁begin｜>42<｜tool▁output▁end｜>"}
    want = AutoTokenizer.from_pretrained(tiny_v3).apply_chat_template([*USER_HI, result], add_generation_prompt=True)
    assert resp.json()["usage"]["prompt_tokens"] == len(want["input_ids"])


# --- 5. FastAPI's own errors in OpenAI's shape ------------------------------------------------------


@pytest.mark.parametrize(
    "raw, content_type, words",
    [
        (b'{"model": "tiny", "prompt": "\xff\xfe"}', "application/json", "not valid UTF-8"),
        (b'{"model": "tiny", "prompt": "a",', "application/json", "could not parse the JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", "nested too deeply"),
        (b'{"model": "tiny", "prompt": "a"}', "text/plain", "Content-Type: application/json"),
        (b'{"model": "tiny", "prompt": "a"}', "", "Content-Type: application/json"),
        (b"", "application/json", "body is missing"),
        (b"[1, 2]", "application/json", "Invalid request body"),
        (b"null", "application/json", "Invalid request body"),
    ],
)
def test_unparsable_bodies_are_400_in_openai_shape(server, raw, content_type, words):
    resp = httpx.post(server.url + COMPLETIONS, content=raw, headers={"content-type": content_type}, timeout=60)
    assert words in assert_error(resp, 400, None)["message"]


def test_unknown_routes_and_methods_are_openai_errors(server):
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404, None)
    resp = httpx.get(server.url + COMPLETIONS)
    assert_error(resp, 405, None)
    assert resp.headers["allow"] == "POST"


# --- 6. fields we cannot honour -------------------------------------------------------------------

FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "path, patch, param",
    [
        (CHAT, {"functions": [FUNCTION["function"]]}, "functions"),
        (CHAT, {"function_call": "auto"}, "function_call"),
        (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
        (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        (CHAT, {"web_search_options": {}}, "web_search_options"),
        (
            CHAT,
            {"messages": [{"role": "assistant", "function_call": {"name": "f"}}, *USER_HI]},
            "messages[0].function_call",
        ),
        (COMPLETIONS, {"suffix": "tail"}, "suffix"),
        (COMPLETIONS, {"best_of": 3}, "best_of"),
    ],
)
def test_unsupported_fields_are_400_not_ignored(server, path, patch, param):
    err = assert_error(post(server, path, {**OK_BODY[path], **patch}), 400, param)
    assert f"{param.rsplit('.', 1)[-1]} is not supported" in err["message"]


@pytest.mark.parametrize(
    "patch",
    [
        {
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "logit_bias": {},
            "modalities": ["text"],
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "parallel_tool_calls": False,
            "store": False,
        },
        {
            "tools": None,
            "response_format": None,
            "audio": None,
            "prediction": None,
            "messages": [{"role": "assistant", "content": "x", "tool_calls": []}, *USER_HI],
        },
    ],
)
def test_their_no_op_values_are_accepted(server, patch):
    assert post(server, CHAT, {**OK_BODY[CHAT], **patch}).status_code == 200


# --- 7 and 8. the OpenAPI document tells the truth ---------------------------------------------------


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    resp = httpx.get(server.url + "/openapi.json")
    assert resp.status_code == 200
    return resp.json()


def request_validator(openapi: dict, path: str):
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema_rs.validator_for({**ref, "components": openapi["components"]})


@pytest.mark.parametrize(
    "path, body, param",
    [
        (COMPLETIONS, {"model": "tiny", "prompt": ""}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": []}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": [[1], []]}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": "a", "stop": ""}, "stop"),
        (COMPLETIONS, {"model": "tiny", "prompt": "a", "presence_penalty": 3}, "presence_penalty"),
        (GENERATE, {"input_ids": []}, "input_ids"),
        (GENERATE, {}, "input_ids"),
        (GENERATE, {"text": "a", "input_ids": [1]}, "input_ids"),
        (GENERATE, {"text": "a", "sampling_params": {"temperature": 150}}, "temperature"),
        (CHAT, {"model": "tiny", "messages": USER_HI, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"model": "tiny", "messages": USER_HI, "top_logprobs": 2, "logprobs": False}, "top_logprobs"),
        (CHAT, {"model": "tiny", "messages": USER_HI, "stream_options": {"include_usage": True}}, "stream_options"),
        (CHAT, {"model": "tiny", "messages": USER_HI, "tools": [{"type": "function", "function": {}}]}, "tools"),
        (CHAT, {"model": "tiny", "messages": USER_HI, "tool_choice": {"type": "function"}}, "tool_choice"),
        (CHAT, {"model": "tiny", "messages": USER_HI, "response_format": {"type": "xml"}}, "response_format.type"),
        (GENERATE, {"text": "a", "sampling_params": {"regex": "a", "ebnf": "b"}}, "sampling_params"),
    ],
)
def test_bodies_the_server_refuses_are_invalid_by_its_schema(server, openapi, path, body, param):
    assert_error(post(server, path, body), 400, param)
    assert not request_validator(openapi, path).is_valid(body)


@pytest.mark.parametrize(
    "path, body",
    [
        (
            COMPLETIONS,
            {"model": "tiny", "prompt": [[1, 2], [3]], "max_tokens": 2, "stop": ["a"], "presence_penalty": 0},
        ),
        (GENERATE, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}),
        (GENERATE, {"text": "a", "input_ids": None, "sampling_params": {"max_new_tokens": 2}}),
        (CHAT, {"model": "tiny", "messages": USER_HI, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}),
        (
            CHAT,
            {
                "model": "tiny",
                "messages": USER_HI,
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
    ],
)
def test_bodies_the_server_accepts_are_valid_by_its_schema(server, openapi, path, body):
    assert post(server, path, body).status_code == 200
    assert request_validator(openapi, path).is_valid(body)


def test_openapi_documents_errors_and_responses(openapi):
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    expected = {
        CHAT: {"400", "401", "404", "413", "503"},
        COMPLETIONS: {"400", "401", "404", "413", "503"},
        GENERATE: {"400", "413", "503"},
    }
    for path, statuses in expected.items():
        responses = openapi["paths"][path]["post"]["responses"]
        assert set(responses) == statuses | {"200"}
        for status in statuses:
            assert responses[status]["content"]["application/json"]["schema"] == error_ref
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    ok = {
        path: openapi["paths"][path][method]["responses"]["200"]["content"]
        for path, method in [(CHAT, "post"), (COMPLETIONS, "post"), (GENERATE, "post"), ("/v1/models", "get")]
    }
    assert {p: c["application/json"]["schema"]["$ref"].rsplit("/", 1)[1] for p, c in ok.items()} == {
        CHAT: "ChatCompletionResponse",
        COMPLETIONS: "CompletionResponse",
        GENERATE: "GenerateResponse",
        "/v1/models": "ModelList",
    }
    assert set(openapi["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "422" not in json.dumps(openapi["paths"]) and "HTTPValidationError" not in openapi["components"]["schemas"]


# --- 9. fuzzing every string field with arbitrary Unicode ---------------------------------------------

SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d\ude00"])  # the last: a pair
TEXT = st.lists(st.one_of(st.characters(), SURROGATES), max_size=12).map("".join) | st.text(max_size=12)
STOP = st.none() | TEXT | st.lists(TEXT, max_size=5)
CONTENT = TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), min_size=1, max_size=3)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer"]), "content": CONTENT}, optional={"name": TEXT}
)
MODEL = st.just("tiny") | TEXT
FUZZ_CHAT = st.fixed_dictionaries(
    {"model": MODEL, "messages": st.lists(MESSAGE, min_size=1, max_size=3), "max_tokens": st.just(1)},
    optional={"stop": STOP, "user": TEXT},
)
FUZZ_COMPLETION = st.fixed_dictionaries(
    {"model": MODEL, "prompt": TEXT | st.lists(TEXT, min_size=1, max_size=3), "max_tokens": st.just(1)},
    optional={"stop": STOP, "user": TEXT},
)
FUZZ_GENERATE = st.fixed_dictionaries(
    {"text": TEXT, "sampling_params": st.fixed_dictionaries({"max_new_tokens": st.just(1)}, optional={"stop": STOP})}
)
FUZZ = (
    st.tuples(st.just(CHAT), FUZZ_CHAT)
    | st.tuples(st.just(COMPLETIONS), FUZZ_COMPLETION)
    | st.tuples(st.just(GENERATE), FUZZ_GENERATE)
)


def test_arbitrary_unicode_in_every_string_field(server):
    statuses = []

    # derandomized: the same requests every run, so a failure reproduces without shrinking, which
    # against a server that has just broken can take many minutes of slow requests
    @settings(
        max_examples=300,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
    )
    @given(FUZZ)
    def one(case):
        path, body = case
        resp = post(server, path, body)
        statuses.append(resp.status_code)
        payload = resp.json()  # always JSON, never a plain-text 500
        unknown_model = resp.status_code == 404 and body.get("model") != "tiny"
        assert resp.status_code in (200, 400) or unknown_model, f"{path} {body!r} -> {resp.status_code} {resp.text}"
        assert ("error" in payload) == (resp.status_code != 200)

    start = time.monotonic()
    one()
    assert time.monotonic() - start < 60
    # both outcomes are exercised, not just refusals
    assert statuses.count(200) >= 20 and statuses.count(400) >= 100
    assert httpx.get(server.url + "/health").status_code == 200


# --- afterwards ---------------------------------------------------------------------------------


def test_the_server_is_unchanged_after_all_this(server, baseline):
    # Last in the file: every malformed request above has been sent.
    assert httpx.get(server.url + "/health").status_code == 200
    assert greedy_texts(server) == baseline
