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

import codecs
import dataclasses
import math
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Optional, Union

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
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from afd_engine.errors import InvalidRequestError
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

    return PlainValidator(validate, json_schema_input_type=Optional[Union[str, list[str]]])


OpenAIStop = Annotated[Optional[list[str]], _stop_validator(MAX_OPENAI_STOP)]
NativeStop = Annotated[Optional[list[str]], _stop_validator(None)]


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
    Optional[str],
    PlainValidator(_validate_content, json_schema_input_type=Optional[Union[str, list[TextContentPart]]]),
]


class StreamOptions(BaseModel):
    """``stream_options``: with ``include_usage`` a last chunk carries the usage."""

    include_usage: StrictBool = False


class ChatMessage(_NullMeansDefault):
    """One input message. Text parts are joined into ``content``; other keys are ignored."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: MessageContent = None
    name: Optional[StrictStr] = None


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


def _has_logprobs_field() -> bool:
    return "logprobs" in SamplingParams.__dataclass_fields__


def _logprobs_kwargs(logprobs: int | None) -> dict:
    """``{"logprobs": k}`` when requested; an error if this engine has no logprobs support."""
    if logprobs is None:
        return {}
    if not _has_logprobs_field():
        raise InvalidRequestError("logprobs are not supported by this server", param="logprobs")
    return {"logprobs": logprobs}


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
    temperature: Optional[OpenAITemperature] = None
    top_p: Optional[TopP] = None
    top_k: Optional[TopK] = None
    seed: Optional[Seed] = None
    stop: OpenAIStop = None
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    user: Optional[StrictStr] = None
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
        raise NotImplementedError

    def _logprobs(self) -> int | None:
        raise NotImplementedError

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
        kwargs.update(_logprobs_kwargs(self._logprobs()))
        return SamplingParams(**kwargs)

    def choice_sampling_params(self, default_max_tokens: int) -> list[SamplingParams]:
        """One SamplingParams per choice (``n`` of them), seeds offset per choice."""
        base = self.to_sampling_params(default_max_tokens)
        return [sampling_params_for_choice(base, i) for i in range(self.n)]


class ChatCompletionRequest(_OpenAISamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[PositiveInt] = None
    max_completion_tokens: Optional[PositiveInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=20)]] = None

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


PromptInput = Union[str, list[str], list[int], list[list[int]]]


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
    max_tokens: Optional[PositiveInt] = None
    logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=5)]] = None
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

    max_new_tokens: Optional[PositiveInt] = None
    temperature: Optional[Annotated[StrictFloat, Field(ge=0.0)]] = None  # upper bound: SamplingParams'
    top_p: Optional[TopP] = None
    top_k: Optional[TopK] = None
    seed: Optional[Seed] = None
    stop: NativeStop = None
    stop_token_ids: Optional[list[NonNegativeInt]] = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=20)]] = None


class GenerateRequest(_NullMeansDefault):
    """``POST /generate``: exactly one of ``text`` and ``input_ids``."""

    model_config = ConfigDict(extra="ignore")

    text: Optional[StrictStr] = None
    input_ids: Optional[list[NonNegativeInt]] = Field(default=None, validate_default=True)
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
        kwargs.update(_logprobs_kwargs(sp.logprobs))
        return SamplingParams(**kwargs)


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


def random_id(prefix: str) -> str:
    """An OpenAI-style object id such as ``chatcmpl-<32 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)


class TopLogprob(BaseModel):
    """One alternative in the chat logprobs format."""

    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprobEntry(BaseModel):
    """One output token in the chat logprobs format, with its most likely alternatives."""

    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """``choices[i].logprobs`` of a chat completion (or of one chunk)."""

    content: Optional[list[TokenLogprobEntry]] = None


class CompletionLogprobs(BaseModel):
    """``choices[i].logprobs`` of a legacy text completion (or of one chunk)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: Optional[list[dict[str, float]]] = None
    text_offset: list[int] = Field(default_factory=list)


FinishReason = Optional[str]  # "stop" | "length" | "abort" | ...; null while a stream goes on


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
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

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        # Only the delta omits absent keys; everywhere else OpenAI writes explicit nulls.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage = Field(default_factory=DeltaMessage)
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(BaseModel):
    """One ``chat.completion.chunk``. With ``include_usage``, a last chunk has no choices and
    carries ``usage``; in every other chunk ``usage`` is null."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice] = Field(default_factory=list)
    usage: Optional[UsageInfo] = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: FinishReason = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class CompletionChunk(BaseModel):
    """A streamed text completion: the same shape as the response (OpenAI's ``object`` is
    ``text_completion`` for both), usage null except in the optional last usage chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "afd-engine"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    """One server-sent event carrying ``payload`` as JSON, as OpenAI streams do."""
    return f"data: {payload.model_dump_json()}\n\n"


# --------------------------------------------------------------------------------------------
# Log-probabilities
# --------------------------------------------------------------------------------------------

# JSON has no -inf, and OpenAI clients require a number; OpenAI itself reports -9999.0 for
# tokens of (numerically) zero probability.
_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else (_MIN_LOGPROB if logprob < 0 or math.isnan(logprob) else 0.0)


def _byte_level_alphabet() -> dict[str, int]:
    """The printable stand-in character of each byte in GPT-2 style byte-level BPE, inverted.

    Bytes that are printable and not whitespace stand for themselves; the other 68 are mapped,
    in byte order, to the code points from 256 upwards. Inverting the map turns a token's
    vocabulary string back into its exact bytes, even when they are an incomplete UTF-8
    character (which decoding the single token would turn into U+FFFD).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


@dataclasses.dataclass(frozen=True)
class TokenText:
    """How one token id is shown in logprobs, and what it adds to the output text."""

    token: str  # display text; "bytes:\\xe4\\xbd" for an incomplete UTF-8 piece, as OpenAI does
    raw: bytes  # exact UTF-8 bytes of the token
    in_text: bool  # False for a special token that the output text skips


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


class LogprobFormatter:
    """Builds chat and completions logprobs from token ids, their logprobs and top-k alternatives.

    One formatter per tokenizer (the server keeps one); each token's text is computed once and
    cached, so formatting costs O(tokens * k) dictionary look-ups.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._byte_level = _is_byte_level(tokenizer)
        self._special_ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
        for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(added, "special", False):
                self._special_ids.add(token_id)
        self._cache: dict[int, TokenText] = {}

    def token_text(self, token_id: int) -> TokenText:
        entry = self._cache.get(token_id)
        if entry is None:
            entry = self._cache[token_id] = self._compute(token_id)
        return entry

    def _compute(self, token_id: int) -> TokenText:
        in_text = not (self.skip_special_tokens and token_id in self._special_ids)
        raw: bytes | None = None
        if self._byte_level and token_id not in self._special_ids:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in _BYTE_OF_CHAR for c in piece):
                raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
        if raw is None:
            # Special/added tokens (written literally in the vocabulary) and other tokenizer
            # kinds: the token decoded on its own.
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            return TokenText(token=text, raw=text.encode("utf-8"), in_text=in_text)
        try:
            token = raw.decode("utf-8")
        except UnicodeDecodeError:
            token = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return TokenText(token=token, raw=raw, in_text=in_text)

    def chat_logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        top: Optional[Sequence[tuple[Sequence[int], Sequence[float]]]] = None,
    ) -> ChatLogprobs:
        """Chat format: per token {token, logprob, bytes, top_logprobs[{token, logprob, bytes}]}.

        ``top[i]`` holds the ids and logprobs of the most likely tokens at position i; None
        (or empty) gives an empty ``top_logprobs``, as OpenAI does for ``top_logprobs: 0``.
        """
        # Plain dicts validated once at the end: pydantic's Rust validator builds the nested models
        # several times faster than one constructor call per entry would.
        content = []
        for i, (token_id, lp) in enumerate(zip(token_ids, logprobs)):
            t = self.token_text(token_id)
            alternatives = []
            if top is not None and i < len(top):
                for alt_id, alt_lp in zip(*top[i]):
                    a = self.token_text(alt_id)
                    alternatives.append({"token": a.token, "logprob": _finite(alt_lp), "bytes": list(a.raw)})
            content.append({"token": t.token, "logprob": _finite(lp), "bytes": list(t.raw), "top_logprobs": alternatives})
        return ChatLogprobs.model_validate({"content": content})

    def completion_logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        top: Optional[Sequence[tuple[Sequence[int], Sequence[float]]]] = None,
        text_offset: int = 0,
    ) -> CompletionLogprobs:
        """Legacy completions format: parallel lists tokens / token_logprobs / top_logprobs /
        text_offset.

        As in OpenAI's API, each ``top_logprobs`` dict also contains the chosen token. Offsets
        are character positions in the output text, starting at ``text_offset`` (pass the
        length of the text streamed before this chunk). They are exact within one call; a
        character whose bytes straddle two calls is counted in the later one.
        """
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        offset = text_offset
        out = CompletionLogprobs(top_logprobs=[] if top is not None else None)
        for i, (token_id, lp) in enumerate(zip(token_ids, logprobs)):
            t = self.token_text(token_id)
            out.tokens.append(t.token)
            out.token_logprobs.append(_finite(lp))
            out.text_offset.append(offset)
            if t.in_text:
                offset += len(decoder.decode(t.raw))
            if out.top_logprobs is not None:
                alternatives = {}
                if i < len(top):
                    for alt_id, alt_lp in zip(*top[i]):
                        alternatives[self.token_text(alt_id).token] = _finite(alt_lp)
                alternatives.setdefault(t.token, _finite(lp))
                out.top_logprobs.append(alternatives)
        return out

    @staticmethod
    def unpack(entries: Sequence[Any]) -> tuple[list[float], list[tuple[list[int], list[float]]]]:
        """(logprobs, top) from the engine's per-token records (``.logprob``, ``.top_ids``,
        ``.top_logprobs``, as in ``afd_engine.runtime.request.TokenLogprob``)."""
        return [e.logprob for e in entries], [(e.top_ids, e.top_logprobs) for e in entries]
