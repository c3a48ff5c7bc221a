"""The streamed chunks written as text are byte for byte the pydantic chunks' events."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from afd_engine.server import protocol as P

TEXTS = [
    "",
    "hello",
    ' a "quoted" \\ back',
    "line\nbreak\ttab\r\x00\x01\x1f\x7f",
    "é 日本 😀 \u2028\u2029",
    "</script>",
]
MODELS = ["bench", 'we"ird\\model é']
FINISH = [None, "stop", "length", "abort"]


def _created(event: str) -> int:
    return json.loads(event.removeprefix("data: "))["created"]


def _completion(rid, model, index, text, finish, created) -> str:
    choice = P.CompletionChoice(index=index, text=text, finish_reason=finish)
    return P.sse_event(P.CompletionChunk(id=rid, model=model, created=created, choices=[choice]))


def _chat(rid, model, index, delta: P.DeltaMessage, finish, created) -> str:
    choice = P.ChatCompletionStreamChoice(index=index, delta=delta, finish_reason=finish)
    return P.sse_event(P.ChatCompletionChunk(id=rid, model=model, created=created, choices=[choice]))


def test_completion_chunks_match_the_models():
    for model in MODELS:
        writer = P.ChunkWriter("completions", "cmpl-abc", model)
        for index, text in enumerate(TEXTS):
            for finish in FINISH:
                event = writer.event(index, text, finish)
                assert event == _completion("cmpl-abc", model, index, text, finish, _created(event))


def test_chat_chunks_match_the_models():
    for model in MODELS:
        writer = P.ChunkWriter("chat", "chatcmpl-abc", model)
        event = writer.event(2, "", None, role=True)  # the first chunk of a choice
        assert event == _chat(
            "chatcmpl-abc", model, 2, P.DeltaMessage(role="assistant", content=""), None, _created(event)
        )
        for text in TEXTS:
            event = writer.event(0, text, None)
            assert event == _chat("chatcmpl-abc", model, 0, P.DeltaMessage(content=text), None, _created(event))
        for finish in FINISH[1:]:  # the last chunk: an empty delta
            event = writer.event(1, None, finish)
            assert event == _chat("chatcmpl-abc", model, 1, P.DeltaMessage(), finish, _created(event))


@settings(max_examples=300, deadline=None)
@given(text=st.text(), index=st.integers(0, 1000))
def test_any_text_is_written_as_the_models_write_it(text, index):
    for kind in ("completions", "chat"):
        event = P.ChunkWriter(kind, "id-1", "m").event(index, text, None)
        if kind == "completions":
            assert event == _completion("id-1", "m", index, text, None, _created(event))
        else:
            assert event == _chat("id-1", "m", index, P.DeltaMessage(content=text), None, _created(event))
