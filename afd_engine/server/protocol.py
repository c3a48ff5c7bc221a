"""Pydantic models of the OpenAI API subset we serve, plus our native ``POST /generate``.

Requests
    ``ChatCompletionRequest`` (``POST /v1/chat/completions``), ``CompletionRequest``
    (``POST /v1/completions``) and ``GenerateRequest`` (``POST /generate``). Types are strict on
    purpose: ``"max_tokens": "5"`` is a client bug that lax coercion would hide, so integers,
    booleans and strings must arrive as such (a JSON integer is still a valid float). Fields we
    do not know are ignored, because OpenAI clients send many optional ones; fields we know but
    cannot honour (penalties, ``echo``) are rejected unless they are the no-op value.
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
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from afd_engine.sampling_params import SamplingParams


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
Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0)]

_SEED_MODULUS = 2**63
MAX_OPENAI_STOP = 4  # OpenAI's limit on the number of stop sequences


def _stop_validator(max_items: int | None):
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
        if max_items is not None and len(items) > max_items:
            raise PydanticCustomError(
                "stop_too_many",
                "at most {max_items} stop sequences are allowed, got {count}",
                {"max_items": max_items, "count": len(items)},
            )
        for item in items:
            if not isinstance(item, str) or not item:
                raise PydanticCustomError("stop_item", "each stop sequence must be a non-empty string")
        return list(items)

    return PlainValidator(validate, json_schema_input_type=str | list[str] | None)


OpenAIStop = Annotated[list[str] | None, _stop_validator(MAX_OPENAI_STOP)]
NativeStop = Annotated[list[str] | None, _stop_validator(None)]


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
    text: StrictStr


# Text parts of one message are joined with a newline: separate parts are separate paragraphs
# to the writer, and gluing them without a separator would merge their words.
_PART_SEPARATOR = "\n"


def _validate_content(value: Any) -> str | None:
    """Message content as one string: a string, a list of text parts, or null."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("content_type", "content must be a string, a list of text parts, or null")
    texts = []
    for part in value:
        if isinstance(part, TextContentPart):
            texts.append(part.text)
            continue
        if not isinstance(part, dict):
            raise PydanticCustomError("content_part", 'each content part must be an object with "type": "text" and a string "text"')
        if part.get("type") != "text":
            raise PydanticCustomError(
                "content_part_type",
                "content parts of type {type} are not supported; only 'text' parts are",
                {"type": repr(part.get("type"))},
            )
        if not isinstance(part.get("text"), str):
            raise PydanticCustomError("content_part_text", "a text content part needs a string 'text'")
        texts.append(part["text"])
    return _PART_SEPARATOR.join(texts)


MessageContent = Annotated[
    str | None,
    PlainValidator(_validate_content, json_schema_input_type=str | list[TextContentPart] | None),
]


class StreamOptions(BaseModel):
    """``stream_options``: with ``include_usage`` a last chunk carries the usage."""

    include_usage: StrictBool = False


class ChatMessage(_NullMeansDefault):
    """One input message. Text parts are joined into ``content``; other keys are ignored."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: MessageContent = None
    name: StrictStr | None = None


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


class _OpenAISamplingRequest(_NullMeansDefault):
    """Fields shared by chat and text completions. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
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
    user: StrictStr | None = None
    ignore_eos: StrictBool = False  # extension

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty_not_supported(cls, value: float | None, info: ValidationInfo) -> float | None:
        # Accepting a non-zero penalty and silently ignoring it would change the output the
        # client asked for, so it is an error; 0 (what many clients send by default) is a no-op.
        if value:
            raise PydanticCustomError("not_supported", "{name} is not supported (only 0 is accepted)", {"name": info.field_name})
        return value

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

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine parameters of the first choice; unset fields take the engine defaults.

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
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        kwargs["logprobs"] = self._logprobs()
        return SamplingParams(**kwargs)

    def choice_sampling_params(self, default_max_tokens: int) -> list[SamplingParams]:
        """One SamplingParams per choice (``n`` of them), seeds offset per choice."""
        base = self.to_sampling_params(default_max_tokens)
        return [sampling_params_for_choice(base, i) for i in range(self.n)]


class ChatCompletionRequest(_OpenAISamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None

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

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as chat templates expect them: plain-string content, "developer" as "system".

        "developer" is OpenAI's newer name for the system role; open-model templates only know
        "system". Null content (an assistant turn that only made tool calls) becomes "".
        """
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
            for m in self.messages
        ]


PromptInput = str | list[str] | list[int] | list[list[int]]


def _validate_prompt(value: Any) -> PromptInput:
    """A non-empty prompt: a string, strings, token ids, or lists of token ids."""

    def is_id(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if isinstance(value, str):
        if not value:
            raise PydanticCustomError("prompt_empty", "prompt must not be empty")
        return value
    if not isinstance(value, list) or not value:
        raise PydanticCustomError(
            "prompt_type", "prompt must be a non-empty string, list of strings, list of token ids, or list of lists of token ids"
        )
    if all(isinstance(x, str) for x in value):
        if not all(value):
            raise PydanticCustomError("prompt_empty", "prompt strings must not be empty")
        return list(value)
    if all(is_id(x) for x in value):
        return list(value)
    if all(isinstance(x, list) for x in value):
        if not all(x and all(is_id(t) for t in x) for x in value):
            raise PydanticCustomError("prompt_ids", "each token-id prompt must be a non-empty list of non-negative integers")
        return [list(x) for x in value]
    raise PydanticCustomError(
        "prompt_type", "prompt must be a non-empty string, list of strings, list of token ids, or list of lists of token ids"
    )


class CompletionRequest(_OpenAISamplingRequest):
    """``POST /v1/completions`` (the legacy text completions API)."""

    prompt: Annotated[PromptInput, PlainValidator(_validate_prompt, json_schema_input_type=PromptInput)]
    max_tokens: PositiveInt | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    echo: StrictBool = False

    @field_validator("echo")
    @classmethod
    def _echo_not_supported(cls, value: bool) -> bool:
        if value:
            raise PydanticCustomError("not_supported", "echo is not supported")
        return value

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

    def _logprobs(self) -> int | None:
        return self.logprobs


class GenerateSamplingParams(_NullMeansDefault):
    """``sampling_params`` of ``POST /generate``: SamplingParams' names, nothing else.

    Unknown keys are rejected here (unlike the OpenAI endpoints): this is our own API, and a
    misspelt ``max_tokens`` silently falling back to the default would be a trap.
    """

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: PositiveInt | None = None
    temperature: Annotated[StrictFloat, Field(ge=0.0)] | None = None  # upper bound: SamplingParams'
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: NativeStop = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None


class GenerateRequest(_NullMeansDefault):
    """``POST /generate``: exactly one of ``text`` and ``input_ids``."""

    model_config = ConfigDict(extra="ignore")

    text: StrictStr | None = None
    input_ids: list[NonNegativeInt] | None = Field(default=None, validate_default=True)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: StrictBool = False

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

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Engine parameters; unset ones take SamplingParams' defaults, max_new_tokens the server's."""
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
            value = getattr(sp, name)
            if value is not None:
                kwargs[name] = value
        kwargs["logprobs"] = sp.logprobs
        return SamplingParams(**kwargs)



from afd_engine.server.responses import *  # noqa: E402,F401,F403  (one import point for routes)
from afd_engine.server.responses import random_id  # noqa: E402,F401
from afd_engine.server.logprobs import LogprobFormatter  # noqa: E402,F401
