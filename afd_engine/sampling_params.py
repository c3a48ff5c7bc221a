"""Per-request sampling settings, validated once when a request is created."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from afd_engine.errors import InvalidRequestError

# What a request's output can be constrained to (SamplingParams.guide).
GUIDE_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request.

    temperature 0 means greedy. ``top_k`` 0 or -1 keeps every token, ``top_p`` 1.0 keeps the
    whole distribution. ``seed`` makes a sampled request reproducible regardless of what else
    is in the batch. Generation stops at ``max_new_tokens``, at the model's EOS (unless
    ``ignore_eos``), at any of ``stop_token_ids`` or when the text ends with one of ``stop``.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: also the k most likely
    # prompt tokens' logprobs from position prompt_logprobs_start on (the first token has none):
    # None: none; 0: each prompt token's; k: also the k most likely. With them, max_new_tokens
    # may be 0 (score the prompt, generate nothing).
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    # Logit processing (vLLM's semantics). presence/frequency penalties subtract from the logit of
    # each token already generated (once / once per occurrence); repetition_penalty divides
    # positive and multiplies negative logits of tokens in the prompt or the output; min_p drops
    # tokens less likely than min_p times the most likely one; EOS and stop_token_ids are
    # forbidden (and stop strings ignored) until min_tokens are out; logit_bias adds its value to
    # its token's logit, as (token id, bias) pairs (a dict is accepted).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Constrained decoding: (kind, spec) with kind one of GUIDE_KINDS; the output is guaranteed to
    # match (a JSON schema, any JSON object, a regular expression, an EBNF grammar, or an xgrammar
    # structural tag such as a tool call format). `runtime/grammar.py` compiles it.
    guide: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        try:
            object.__setattr__(self, "logit_bias", tuple((k, v) for k, v in bias))
        except (TypeError, ValueError):
            raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias") from None
        if self.guide is not None and not isinstance(self.guide, str):
            object.__setattr__(self, "guide", tuple(self.guide))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property  # (read per request on every step: computed once)
    def penalized(self) -> bool:
        """Whether its logits depend on the tokens seen so far (presence, frequency, repetition)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @functools.cached_property
    def processed(self) -> bool:
        """Whether anything bends its logits before the sampler (penalties, bias, min_tokens, a guide)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.guide is not None

    def validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}", param=name)

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise bad("max_new_tokens", "must be an integer")
        if self.max_new_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise bad("max_new_tokens", "must be at least 1 (0 only with prompt logprobs)")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise bad("temperature", "must be a number")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or (self.top_k < 1 and self.top_k not in (0, -1))
        ):
            raise bad("top_k", "must be a positive integer, or 0 / -1 to disable")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", "must be a non-negative integer")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20
        ):
            raise bad("logprobs", "must be an integer in [0, 20]")
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool)
            or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", "must be an integer in [0, 20]")
        if (
            isinstance(self.prompt_logprobs_start, bool)
            or not isinstance(self.prompt_logprobs_start, int)
            or self.prompt_logprobs_start < 0
        ):
            raise bad("prompt_logprobs_start", "must be a non-negative integer")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if any(not _is_unicode(s) for s in self.stop):
            raise bad("stop", "stop strings must be valid Unicode (a lone UTF-16 surrogate is not)")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be a number in (0, 2]")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be a number in [0, 1]")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be a non-negative integer")
        if self.min_tokens > self.max_new_tokens:
            raise bad("min_tokens", f"must not exceed max_new_tokens ({self.max_new_tokens})")
        for token, value in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise bad("logit_bias", f"token ids must be non-negative integers (got {token!r})")
            if not _is_number(value) or not -100.0 <= value <= 100.0:
                raise bad("logit_bias", f"the bias of token {token} must be a number in [-100, 100]")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise bad("logit_bias", "a token id appears twice")
        if self.guide is not None and (
            len(self.guide) != 2
            or self.guide[0] not in GUIDE_KINDS
            or not isinstance(self.guide[1], str)
            or (self.guide[0] != "json_object" and not self.guide[1])
        ):
            raise bad("guide", f"must be (kind, spec) with kind one of {', '.join(GUIDE_KINDS)} and a non-empty spec")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # (not NaN)


def _is_unicode(text: str) -> bool:
    """False for strings holding lone UTF-16 surrogates (legal in JSON, not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
