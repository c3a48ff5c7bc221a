"""Response bodies of the OpenAI API subset we serve, with OpenAI's exact field names and nulls."""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import (
    BaseModel,
    Field,
    model_serializer,
)

# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


def random_id(prefix: str) -> str:
    """An OpenAI-style object id such as ``chatcmpl-<32 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class TopLogprob(BaseModel):
    """One alternative in the chat logprobs format."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(BaseModel):
    """One output token in the chat logprobs format, with its most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """``choices[i].logprobs`` of a chat completion (or of one chunk)."""

    content: list[TokenLogprobEntry] | None = None


class CompletionLogprobs(BaseModel):
    """``choices[i].logprobs`` of a legacy text completion (or of one chunk)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # null: an echoed first prompt token
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


FinishReason = str | None  # "stop" | "length" | "abort" | ...; null while a stream goes on


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # the arguments as JSON text


class ToolCallOut(BaseModel):
    """One tool call the model made (``message.tool_calls[i]``)."""

    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first one of a call carries its id, type and name,
    later ones argument text (``delta.tool_calls[j]``, by ``index``)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A streamed message delta. Unset keys are left out (OpenAI sends ``{}`` at the end)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        # Only the delta omits absent keys; everywhere else OpenAI writes explicit nulls.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage = Field(default_factory=DeltaMessage)
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(BaseModel):
    """One ``chat.completion.chunk``. With ``include_usage``, a last chunk has no choices and
    carries ``usage``; in every other chunk ``usage`` is null."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    """A streamed text completion: the same shape as the response (OpenAI's ``object`` is
    ``text_completion`` for both), usage null except in the optional last usage chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "afd-engine"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class GenerateMetaInfo(BaseModel):
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # with return_logprob (SGLang's layout): [logprob, token id, null] per token
    output_token_logprobs: list[list[float | int | None]] | None = None
    input_token_logprobs: list[list[float | int | None]] | None = None
    output_top_logprobs: list[list[list[float | int | None]]] | None = None
    input_top_logprobs: list[list[list[float | int | None]] | None] | None = None
    # prefill-decode disaggregation (decode instance): the time to first token split into queue
    # (reservation + the prefill instance's queue), prefill, transfer (sending the pages), and
    # first_decode_step (from the KV's arrival to the second token); seconds, and transfer_bytes
    timeline: dict[str, float] | None = None


class GenerateResponse(BaseModel):
    """``POST /generate`` without streaming."""

    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo


class HealthStatus(BaseModel):
    status: Literal["ok", "unavailable", "draining"]


SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    """One server-sent event carrying ``payload`` as JSON, as OpenAI streams do."""
    return f"data: {payload.model_dump_json()}\n\n"


_json_text = json.JSONEncoder(ensure_ascii=False).encode  # escapes as pydantic's serializer does


class ChunkWriter:
    """The events of a streamed chat or text completion whose chunks carry no logprobs, written
    straight as text: byte for byte what ``sse_event`` makes of the ``ChatCompletionChunk`` or
    ``CompletionChunk`` (with ``usage`` null), without building and serializing a model per token."""

    def __init__(self, kind: Literal["chat", "completions"], rid: str, model: str) -> None:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._head = f'data: {{"id":{_json_text(rid)},"object":"{obj}","created":'
        self._model = f',"model":{_json_text(model)},"choices":[{{"index":'
        self._chat = kind == "chat"

    def event(self, index: int, text: str | None, finish_reason: str | None, role: bool = False) -> str:
        """One chunk of choice `index`: its text (for chat, the delta's content: None leaves it
        out) and finish reason; `role` (chat only) adds the assistant role to the delta."""
        if self._chat:
            fields = ['"role":"assistant"'] if role else []
            if text is not None:
                fields.append(f'"content":{_json_text(text)}')
            body = f'"delta":{{{",".join(fields)}}}'
        else:
            body = f'"text":{_json_text(text)}'
        finish = "null" if finish_reason is None else _json_text(finish_reason)
        tail = f',"logprobs":null,"finish_reason":{finish}}}],"usage":null}}\n\n'
        return f"{self._head}{_now()}{self._model}{index},{body}{tail}"
