"""Per-request sampling settings, validated once when a request is created."""

from __future__ import annotations

from dataclasses import dataclass

from afd_engine.errors import InvalidRequestError


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

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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


def _is_unicode(text: str) -> bool:
    """False for strings holding lone UTF-16 surrogates (legal in JSON, not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
