"""Pydantic models of the OpenAI API subset we serve, plus our native ``POST /generate``.

Requests
    ``ChatCompletionRequest`` (``POST /v1/chat/completions``), ``CompletionRequest``
    (``POST /v1/completions``) and ``GenerateRequest`` (``POST /generate``). Types are strict on
    purpose: ``"max_tokens": "5"`` is a client bug that lax coercion would hide, so integers,
    booleans and strings must arrive as such (a JSON integer is still a valid float). Fields we
    do not know are ignored, because OpenAI clients send many optional ones; fields we know but
    cannot honour (penalties, ``tools``, ``response_format``, ...) are rejected unless
    they are the no-op value, and their JSON schema says which value that is.
    Every string that reaches the tokenizer, the chat template or the stop checker must be valid
    Unicode (see :data:`Text`), and stop strings are bounded in number and length.
    Each request maps onto the engine's :class:`SamplingParams` with ``to_sampling_params``;
    ``SamplingParams``' own ``InvalidRequestError`` propagates unchanged.

Responses
    The models use OpenAI's exact field names and are meant to be serialized with a plain
    ``model_dump_json()``: fields that OpenAI clients expect to see as ``null``
    (``finish_reason``, ``logprobs``, ``usage`` in chunks) are always written, and the one
    place where OpenAI omits absent keys, the streaming ``delta``, drops them by itself.

Log-probabilities
    :class:`LogprobFormatter` turns the engine's (token id, logprob, top-k) data into the chat
    and legacy completions logprobs formats, caching each token's text and bytes.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from afd_engine.sampling_params import SamplingParams
from afd_engine.server.request_defaults import _or_default, _processing, generation_defaults  # noqa: F401
from afd_engine.server.tool_calls import check_tool_choice, check_tools, tool_call_guide

# --------------------------------------------------------------------------------------------
# Field types
# --------------------------------------------------------------------------------------------

PositiveInt = Annotated[StrictInt, Field(ge=1)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
# Seeds are int64 on the OpenAI side; the upper bound keeps seed + choice index representable.
Seed = Annotated[StrictInt, Field(ge=0, le=2**63 - 1)]
# StrictFloat still accepts JSON integers (``"temperature": 1``), but not strings or booleans.
OpenAITemperature = Annotated[StrictFloat, Field(ge=0.0, le=2.0)]
TopP = Annotated[StrictFloat, Field(gt=0.0, le=1.0)]
# top_k is our extension: -1 or 0 disable it, as in SamplingParams.
TopK = Annotated[StrictInt, Field(ge=-1)]

# Logit processing (vLLM's semantics; SamplingParams documents them).
Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[StrictFloat, Field(gt=0.0, le=2.0)]
MinP = Annotated[StrictFloat, Field(ge=0.0, le=1.0)]
MAX_LOGIT_BIAS = 1024  # entries per request


def _validate_logit_bias(value: Any) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's ``{"token id": bias}`` (ids as decimal strings) as (id, bias) pairs."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise PydanticCustomError("logit_bias", "logit_bias must be an object mapping token ids to biases")
    if len(value) > MAX_LOGIT_BIAS:
        raise PydanticCustomError("logit_bias", "logit_bias has more than {n} entries", {"n": MAX_LOGIT_BIAS})
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()) or len(key) > 12:
            raise PydanticCustomError(
                "logit_bias", "logit_bias keys must be token ids (decimal strings), not {key}", {"key": repr(key)}
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise PydanticCustomError("logit_bias", "logit_bias values must be numbers in [-100, 100]")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


LogitBias = Annotated[
    tuple[tuple[int, float], ...] | None,
    PlainValidator(
        _validate_logit_bias,
        json_schema_input_type=Annotated[
            dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-100, le=100)]],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None,
    ),
]

_SEED_MODULUS = 2**63
MAX_OPENAI_STOP = 4  # OpenAI's limit on the number of stop sequences
# /generate's own limit: the stop checker scans a window as long as the longest stop string after
# every token, for every string, so both the count and the length bound the per-token work.
MAX_NATIVE_STOP = 16
MAX_STOP_CHARS = 1000

# JSON's \uXXXX escapes can spell a lone UTF-16 surrogate ("\ud800"). Python keeps it in a str,
# but no UTF-8 encoder accepts it: the tokenizer, the stop checker and the response writer would
# all fail on it far from the request, so it is refused here, naming the field.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(value: str) -> str:
    """``value`` unchanged if it is valid Unicode; a validation error otherwise."""
    if _LONE_SURROGATE.search(value):
        raise PydanticCustomError(
            "invalid_unicode", "the string is not valid Unicode (it holds a lone UTF-16 surrogate)"
        )
    return value


# A string that is safe to tokenize, render and echo back.
Text = Annotated[StrictStr, AfterValidator(check_unicode)]
NonEmptyText = Annotated[StrictStr, Field(min_length=1), AfterValidator(check_unicode)]
StopText = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def _stop_validator(max_items: int):
    """A plain validator for ``stop``: a string or a list of non-empty strings, as a list.

    A plain validator (rather than ``Union[str, list[str]]``) gives one readable error instead of
    one error per union member.
    """

    def validate(value: Any) -> list[str] | None:
        if value is None:
            return None
        if isinstance(value, str):
            items = [value]
        elif isinstance(value, list):
            items = value
        else:
            raise PydanticCustomError("stop_type", "stop must be a string or a list of strings")
        if len(items) > max_items:
            raise PydanticCustomError(
                "stop_too_many",
                "at most {max_items} stop sequences are allowed, got {count}",
                {"max_items": max_items, "count": len(items)},
            )
        for item in items:
            if not isinstance(item, str) or not item:
                raise PydanticCustomError("stop_item", "each stop sequence must be a non-empty string")
            if len(item) > MAX_STOP_CHARS:
                raise PydanticCustomError(
                    "stop_too_long",
                    "each stop sequence must be at most {limit} characters, got {count}",
                    {"limit": MAX_STOP_CHARS, "count": len(item)},
                )
            check_unicode(item)
        return list(items)

    schema = StopText | Annotated[list[StopText], Field(max_length=max_items)] | None
    return PlainValidator(validate, json_schema_input_type=schema)


OpenAIStop = Annotated[list[str] | None, _stop_validator(MAX_OPENAI_STOP)]
NativeStop = Annotated[list[str] | None, _stop_validator(MAX_NATIVE_STOP)]


def no_op_only(accepts: Callable[[Any], bool], schema: Any, accepted: str):
    """A field we know but cannot honour: only its no-op value (or null) passes.

    Ignoring, say, ``tools`` or ``response_format: json_object`` would return output of another
    shape than the client asked for, so anything else is a 400 that says so. ``schema`` is what
    the OpenAPI document shows: exactly the accepted values, so the schema never promises more.
    """

    def validate(value: Any, info: ValidationInfo) -> Any:
        if value is None or accepts(value):
            return value
        raise PydanticCustomError(
            "not_supported",
            "{name} is not supported by this server (only {accepted} is accepted)",
            {"name": info.field_name, "accepted": accepted},
        )

    return Annotated[Any, PlainValidator(validate, json_schema_input_type=None if schema is None else schema | None)]


def _is_number(value: Any, target: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == target


def _is_empty(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not value


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: the output must be JSON valid against ``schema``."""

    model_config = ConfigDict(populate_by_name=True)

    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("json_schema", 'response_format of type "json_schema" needs a json_schema object')
        return self

    def guide(self) -> tuple[str, str] | None:
        if self.type == "json_object":
            return ("json_object", "")
        if self.type == "json_schema":
            return ("json_schema", json.dumps(self.json_schema.schema_ or {}))
        return None


EmptyList = Annotated[list[Any], Field(max_length=0)]
NoTools = no_op_only(lambda v: _is_empty(v, list), EmptyList, "an empty list")
NoToolChoice = no_op_only(lambda v: v == "none", Literal["none"], '"none"')
TextModalities = no_op_only(
    lambda v: v == ["text"], Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)], '["text"]'
)
NullOnly = no_op_only(lambda v: False, None, "null")


class _NullMeansDefault(BaseModel):
    """An explicit JSON null for an optional field means "use the default".

    The OpenAI spec marks most request fields nullable and some clients send ``"n": null`` or
    ``"stream": null``; without this they would fail the strict types of fields whose default
    is not None. Required fields keep their null, so the error still names them.
    """

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or (k in fields and fields[k].is_required())}
        return data


class TextContentPart(BaseModel):
    """One part of a multi-part message content. Only text parts are supported."""

    type: Literal["text"]
    text: Text


# Text parts of one message are joined with a newline: separate parts are separate paragraphs
# to the writer, and gluing them without a separator would merge their words.
_PART_SEPARATOR = "\n"


def _validate_content(value: Any) -> str | None:
    """Message content as one string: a string, a list of text parts, or null."""
    if value is None or isinstance(value, str):
        return value if value is None else check_unicode(value)
    if not isinstance(value, list):
        raise PydanticCustomError("content_type", "content must be a string, a list of text parts, or null")
    texts = []
    for part in value:
        if isinstance(part, TextContentPart):
            texts.append(part.text)
            continue
        if not isinstance(part, dict):
            raise PydanticCustomError(
                "content_part", 'each content part must be an object with "type": "text" and a string "text"'
            )
        if part.get("type") != "text":
            raise PydanticCustomError(
                "content_part_type",
                "content parts of type {type} are not supported; only 'text' parts are",
                {"type": repr(part.get("type"))},
            )
        if not isinstance(part.get("text"), str):
            raise PydanticCustomError("content_part_text", "a text content part needs a string 'text'")
        texts.append(check_unicode(part["text"]))
    return _PART_SEPARATOR.join(texts)


MessageContent = Annotated[
    str | None,
    PlainValidator(_validate_content, json_schema_input_type=str | list[TextContentPart] | None),
]


class StreamOptions(BaseModel):
    """``stream_options``: with ``include_usage`` a last chunk carries the usage."""

    include_usage: StrictBool = False


class MessageToolCallFunction(BaseModel):
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class MessageToolCall(BaseModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    id: Text
    type: Literal["function"] = "function"
    function: MessageToolCallFunction


class ChatMessage(_NullMeansDefault):
    """One input message. Text parts are joined into ``content``; unknown keys are ignored.

    An assistant turn's ``tool_calls`` go to the template with it; the legacy ``function_call`` is
    refused rather than dropped: the template would render the turn without it and the model would
    see a different history.
    """

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: MessageContent = None
    name: Text | None = None
    tool_call_id: Text | None = None  # of a "tool" message; handed to the template as is
    tool_calls: list[MessageToolCall] | None = None
    function_call: NullOnly = None

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates expect it: plain-string content, "developer" as "system".

        "developer" is OpenAI's newer name for the system role; open-model templates only know
        "system". Null content (an assistant turn that only made tool calls) becomes "". Optional
        keys are only present when set, as templates test them with ``is defined``.
        """
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return out


# --------------------------------------------------------------------------------------------
# Tools
# --------------------------------------------------------------------------------------------


class FunctionSchema(BaseModel):
    """What the OpenAPI document shows of a tool's function (server/tool_calls/validation.py checks it)."""

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSchema(BaseModel):
    type: Literal["function"]
    function: FunctionSchema


class NamedToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedToolChoiceFunction


def _custom_error(kind: str, exc: Exception) -> PydanticCustomError:
    return PydanticCustomError(kind, "{message}", {"message": str(exc)})


def _validate_tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    try:
        return check_tools(value)
    except ValueError as exc:
        raise _custom_error("tools", exc) from None


def _validate_tool_choice(value: Any, info: ValidationInfo) -> str | dict | None:
    if value is None:
        return None
    try:
        return check_tool_choice(value, info.data.get("tools"))
    except ValueError as exc:
        raise _custom_error("tool_choice", exc) from None


Tools = Annotated[list[dict] | None, PlainValidator(_validate_tools, json_schema_input_type=list[ToolSchema] | None)]
ToolChoice = Annotated[
    str | dict | None,
    PlainValidator(
        _validate_tool_choice, json_schema_input_type=Literal["none", "auto", "required"] | NamedToolChoice | None
    ),
]


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


def sampling_params_for_choice(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of choice ``index`` of an ``n``-choice request.

    With a seed, choice i uses seed + i: the choices differ from each other, yet the whole
    response is reproducible from the one seed. Without a seed every choice samples freely.
    """
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % _SEED_MODULUS)


class RouterResume(BaseModel):
    """A streamed request `afd router` resumes on this instance after it lost the decode instance
    that streamed its start (server/pd_failover.py): per choice, the tokens the client has; the
    stream's id, which the resumed stream's chunks keep."""

    model_config = ConfigDict(extra="forbid")

    output_ids: list[list[NonNegativeInt]]
    id: Text | None = None


class _Disaggregated(BaseModel):
    """SGLang's fields for prefill-decode disaggregation, which `afd router` adds to a request: the
    room names it on both instances; the decode instance reaches the prefill instance's bootstrap
    server at bootstrap_host:bootstrap_port."""

    bootstrap_host: Text | None = None
    bootstrap_port: Annotated[StrictInt, Field(ge=1, le=65535)] | None = None
    bootstrap_room: Annotated[StrictInt, Field(ge=0, lt=2**63 - 64)] | None = None
    # `afd router`'s own, for its failover (left out of the API's schema): a stream that carries
    # each update's token ids for it, and a request it resumes (with a room only)
    afd_token_ids: SkipJsonSchema[StrictBool] = False
    afd_resume: SkipJsonSchema[RouterResume | None] = None

    def disaggregation(self, index: int) -> dict | None:
        """What the engine takes for choice `index` (each choice is a request of its own room)."""
        if self.bootstrap_room is None:
            return None
        out: dict = {"room": self.bootstrap_room + index}
        if self.bootstrap_host is not None and self.bootstrap_port is not None:
            out["bootstrap"] = f"{self.bootstrap_host}:{self.bootstrap_port}"
        if self.afd_resume is not None:
            resumed = self.afd_resume.output_ids
            out["resume"] = list(resumed[index]) if index < len(resumed) else []
        return out

    @property
    def resumed(self) -> bool:
        """A request `afd router` resumes here: what the client has is not sent again."""
        return self.afd_resume is not None and self.bootstrap_room is not None


class _OpenAISamplingRequest(_NullMeansDefault, _Disaggregated):
    """Fields shared by chat and text completions. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: Text
    temperature: OpenAITemperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: OpenAIStop = None
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias = None
    response_format: ResponseFormat | None = None
    user: Text | None = None
    # extensions (vLLM's names)
    ignore_eos: StrictBool = False
    repetition_penalty: RepetitionPenalty | None = None
    min_p: MinP | None = None
    min_tokens: NonNegativeInt | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise PydanticCustomError("stream_options", "stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def _max_tokens(self) -> int | None:
        """The requested completion length; each endpoint names it its own way."""
        return getattr(self, "max_tokens", None)

    def _logprobs(self) -> int | None:
        """Top-logprob count for the engine (None: none); chat and completions spell it differently."""
        return None

    def to_sampling_params(self, default_max_tokens: int, model_defaults: dict | None = None) -> SamplingParams:
        """The engine parameters of the first choice; unset fields take the model's defaults
        (`model_defaults`: temperature / top_p / top_k of its generation_config.json), then the
        engine's.

        ``max_tokens`` defaults to ``default_max_tokens`` (the server typically passes what is
        left of the context after the prompt); OpenAI's default temperature and top_p are 1,
        which are SamplingParams' defaults too.
        """
        max_tokens = self._max_tokens()
        kwargs: dict[str, Any] = {
            "max_new_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "stop": tuple(self.stop or ()),
            "ignore_eos": self.ignore_eos,
        }
        for name in ("temperature", "top_p", "top_k", "seed"):
            value = _or_default(getattr(self, name), name, model_defaults)
            if value is not None:
                kwargs[name] = value
        kwargs["logprobs"] = self._logprobs()
        kwargs.update(self._prompt_scoring())
        kwargs.update(_processing(self))
        kwargs.update(self._extra_params())
        guide = self.guide()
        if guide is not None:
            kwargs["guide"] = guide[0]
        return SamplingParams(**kwargs)

    def _extra_params(self) -> dict[str, Any]:
        return {}

    def guide(self) -> tuple[tuple[str, str], str] | None:
        """(the guide constraining the output, the request field that set it), or None."""
        guide = self.response_format.guide() if self.response_format is not None else None
        return None if guide is None else (guide, "response_format")

    def _prompt_scoring(self) -> dict[str, Any]:
        """SamplingParams for the prompt's own logprobs (completions' echo); none by default."""
        return {}

    def choice_sampling_params(
        self, default_max_tokens: int, model_defaults: dict | None = None
    ) -> list[SamplingParams]:
        """One SamplingParams per choice (``n`` of them), seeds offset per choice."""
        base = self.to_sampling_params(default_max_tokens, model_defaults)
        return [sampling_params_for_choice(base, i) for i in range(self.n)]


def _requires(field: str, schema: dict, then_field: str, then_schema: dict) -> dict:
    """JSON schema for "when ``field`` matches ``schema``, ``then_field`` must match ``then_schema``",
    so the OpenAPI document states the cross-field rules the validators enforce."""
    return {
        "if": {"required": [field], "properties": {field: schema}},
        "then": {"required": [then_field], "properties": {then_field: then_schema}},
    }


class ChatCompletionRequest(_OpenAISamplingRequest):
    """``POST /v1/chat/completions``. Tool calling and structured output are not supported."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "allOf": [
                _requires("top_logprobs", {"type": "integer"}, "logprobs", {"const": True}),
                _requires("stream_options", {"type": "object"}, "stream", {"const": True}),
            ]
        },
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: Tools = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: StrictBool = True
    functions: NoTools = None
    function_call: NoToolChoice = None
    modalities: TextModalities = None
    audio: NullOnly = None
    prediction: NullOnly = None
    web_search_options: NullOnly = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs", False):
            raise PydanticCustomError("top_logprobs", "top_logprobs requires logprobs to be true")
        return value

    def _max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are given.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    _parser: str = PrivateAttr("deepseekv3")  # the server's tool-call format (set by the route)

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as chat templates expect them (see :meth:`ChatMessage.template_message`)."""
        return [m.template_message() for m in self.messages]

    def tool_mode(self) -> str | dict:
        """ "none", "auto", "required" or a named function (OpenAI's default: auto with tools)."""
        return check_tool_choice(self.tool_choice, self.tools)

    def active_tools(self) -> list[dict] | None:
        """The tools the model is shown and may call (none when tool_choice is "none")."""
        return self.tools if self.tools and self.tool_mode() != "none" else None

    def with_tool_parser(self, parser: str) -> ChatCompletionRequest:
        self._parser = parser
        return self

    @property
    def tool_parser(self) -> str:
        return self._parser

    def guide(self) -> tuple[tuple[str, str], str] | None:
        """Tool calls the model must make (required, a named function) are enforced by a grammar,
        as are the calls it chooses to make (auto: once it opens a call, the call is well formed);
        else response_format's guide."""
        mode, tools = self.tool_mode(), self.active_tools()
        formatted = self.response_format is not None and self.response_format.type != "text"
        if tools and (mode != "auto" or not formatted):
            spec = tool_call_guide(self._parser, tools, mode, self.parallel_tool_calls)
            if spec is not None:
                return ("structural_tag", spec), "tools"
        return super().guide()

    def _extra_params(self) -> dict[str, Any]:
        # a checkpoint's tool-call markers are special tokens: the parser must see them
        return {"skip_special_tokens": False} if self.active_tools() else {}

    def text_chars(self) -> int:
        """Characters of text that go through the chat template, for the server's prompt limit."""
        return sum(len(m.content or "") + len(m.name or "") + len(m.tool_call_id or "") for m in self.messages)


PromptInput = str | list[str] | list[int] | list[list[int]]
_TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
# What the schema shows: every form non-empty, as _validate_prompt enforces.
_PromptText = Annotated[str, Field(min_length=1)]
_PromptSchema = (
    _PromptText
    | Annotated[list[_PromptText], Field(min_length=1)]
    | _TokenIds
    | Annotated[list[_TokenIds], Field(min_length=1)]
)


def _validate_prompt(value: Any) -> PromptInput:
    """A non-empty prompt: a string, strings, token ids, or lists of token ids."""

    def is_id(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if isinstance(value, str):
        if not value:
            raise PydanticCustomError("prompt_empty", "prompt must not be empty")
        return check_unicode(value)
    if not isinstance(value, list) or not value:
        raise PydanticCustomError(
            "prompt_type",
            "prompt must be a non-empty string, list of strings, list of token ids, or list of lists of token ids",
        )
    if all(isinstance(x, str) for x in value):
        if not all(value):
            raise PydanticCustomError("prompt_empty", "prompt strings must not be empty")
        return [check_unicode(x) for x in value]
    if all(is_id(x) for x in value):
        return list(value)
    if all(isinstance(x, list) for x in value):
        if not all(x and all(is_id(t) for t in x) for x in value):
            raise PydanticCustomError(
                "prompt_ids", "each token-id prompt must be a non-empty list of non-negative integers"
            )
        return [list(x) for x in value]
    raise PydanticCustomError(
        "prompt_type",
        "prompt must be a non-empty string, list of strings, list of token ids, or list of lists of token ids",
    )


class CompletionRequest(_OpenAISamplingRequest):
    """``POST /v1/completions`` (the legacy text completions API)."""

    prompt: Annotated[PromptInput, PlainValidator(_validate_prompt, json_schema_input_type=_PromptSchema)]
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    # echo: the prompt comes back before the completion; with logprobs, with its tokens' logprobs
    # (the first token's null), and max_tokens 0 scores the prompt without generating (evaluators)
    echo: StrictBool = False
    max_tokens: NonNegativeInt | None = None
    suffix: no_op_only(lambda v: v == "", Literal[""], '""') = None
    best_of: no_op_only(lambda v: _is_number(v, 1), Literal[1], "1") = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, each a string or a list of token ids.

        OpenAI returns ``n`` choices per prompt, the choices of prompt p having indices
        ``p * n ... p * n + n - 1``.
        """
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return list(p)

    def _max_tokens(self) -> int | None:
        # OpenAI's legacy default is 16 tokens, which surprises more than it helps; an unset
        # max_tokens means "up to the server's default" here, as in chat.
        return self.max_tokens

    @field_validator("max_tokens")
    @classmethod
    def _zero_tokens_only_to_score(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not (info.data.get("echo") and info.data.get("logprobs") is not None):
            raise PydanticCustomError(
                "max_tokens", "max_tokens 0 scores the prompt only: it needs echo true and logprobs set"
            )
        return value

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_scoring(self) -> dict[str, Any]:
        return {"prompt_logprobs": self.logprobs} if self.echo and self.logprobs is not None else {}

    def text_chars(self) -> int:
        """Characters of text to tokenize, for the server's prompt limit."""
        return sum(len(p) for p in self.prompts() if isinstance(p, str))


class GenerateSamplingParams(_NullMeansDefault):
    """``sampling_params`` of ``POST /generate``: SamplingParams' names, nothing else.

    Unknown keys are rejected here (unlike the OpenAI endpoints): this is our own API, and a
    misspelt ``max_tokens`` silently falling back to the default would be a trap.
    """

    model_config = ConfigDict(
        extra="forbid",
        # at most one guide: no two of them together (what _one_guide enforces)
        json_schema_extra={
            "not": {
                "anyOf": [
                    {"required": [a, b]}
                    for i, a in enumerate(("json_schema", "regex", "ebnf", "structural_tag"))
                    for b in ("json_schema", "regex", "ebnf", "structural_tag")[i + 1 :]
                ]
            }
        },
    )

    max_new_tokens: NonNegativeInt | None = None  # 0: score the prompt only (return_logprob)
    # SamplingParams enforces the upper bound (with its own message); the schema shows it.
    temperature: Annotated[StrictFloat, Field(ge=0.0, json_schema_extra={"maximum": 100.0})] | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: NativeStop = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_p: MinP | None = None
    min_new_tokens: NonNegativeInt | None = None
    logit_bias: LogitBias = None
    # constrained decoding (SGLang's names): at most one of them
    json_schema: Text | None = None
    regex: Text | None = None
    ebnf: Text | None = None
    structural_tag: Text | None = None

    @model_validator(mode="after")
    def _one_guide(self) -> GenerateSamplingParams:
        given = [name for name in GENERATE_GUIDES if getattr(self, name) is not None]
        if len(given) > 1:
            raise PydanticCustomError("guide", "give at most one of {names}", {"names": ", ".join(given)})
        return self


GENERATE_GUIDES = ("json_schema", "regex", "ebnf", "structural_tag")


class GenerateRequest(_NullMeansDefault, _Disaggregated):
    # SGLang's logprob fields: with return_logprob, meta_info carries output_token_logprobs and,
    # from prompt position logprob_start_len on (-1: none), input_token_logprobs; each entry is
    # [logprob, token id, null] (the first prompt token's logprob is null); top_logprobs_num > 0
    # adds output_top_logprobs / input_top_logprobs.
    """``POST /generate``: exactly one of ``text`` and ``input_ids``."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "oneOf": [
                {"required": ["text"], "properties": {"text": {"type": "string"}}},
                {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}},
            ]
        },
    )

    text: Text | None = None
    input_ids: Annotated[list[NonNegativeInt], Field(min_length=1)] | None = Field(default=None, validate_default=True)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: StrictBool = False
    return_logprob: StrictBool = False
    logprob_start_len: Annotated[StrictInt, Field(ge=-1)] = -1
    top_logprobs_num: Annotated[StrictInt, Field(ge=0, le=20)] = 0

    @field_validator("input_ids")
    @classmethod
    def _exactly_one_input(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        has_text = info.data.get("text") is not None
        if value is None and not has_text and "text" in info.data:
            raise PydanticCustomError("missing_input", "one of input_ids or text is required")
        if value is not None and has_text:
            raise PydanticCustomError("both_inputs", "give either input_ids or text, not both")
        if value is not None and not value:
            raise PydanticCustomError("empty_input", "input_ids must not be empty")
        return value

    def to_sampling_params(self, default_max_tokens: int, model_defaults: dict | None = None) -> SamplingParams:
        """Engine parameters; unset ones take the model's defaults, then SamplingParams',
        max_new_tokens the server's."""
        sp = self.sampling_params
        kwargs: dict[str, Any] = {
            "max_new_tokens": default_max_tokens if sp.max_new_tokens is None else sp.max_new_tokens,
            "stop": tuple(sp.stop or ()),
            "stop_token_ids": tuple(sp.stop_token_ids or ()),
            "ignore_eos": sp.ignore_eos,
            "include_stop_str_in_output": sp.include_stop_str_in_output,
            "skip_special_tokens": sp.skip_special_tokens,
        }
        for name in ("temperature", "top_p", "top_k", "seed"):
            value = _or_default(getattr(sp, name), name, model_defaults)
            if value is not None:
                kwargs[name] = value
        kwargs["logprobs"] = sp.logprobs
        if self.return_logprob:
            kwargs["logprobs"] = max(self.top_logprobs_num, sp.logprobs or 0)
            if self.logprob_start_len >= 0:
                kwargs["prompt_logprobs"] = self.top_logprobs_num
                kwargs["prompt_logprobs_start"] = self.logprob_start_len
        kwargs.update(_processing(sp))
        guide = self.guide()
        if guide is not None:
            kwargs["guide"] = guide[0]
        return SamplingParams(**kwargs)

    def guide(self) -> tuple[tuple[str, str], str] | None:
        for name in GENERATE_GUIDES:
            spec = getattr(self.sampling_params, name)
            if spec is not None:
                return (name, spec), f"sampling_params.{name}"
        return None

    def text_chars(self) -> int:
        return len(self.text or "")


from afd_engine.server.logprobs import LogprobFormatter  # noqa: E402,F401
from afd_engine.server.responses import *  # noqa: E402,F401,F403  (one import point for routes)
from afd_engine.server.responses import random_id  # noqa: E402,F401
