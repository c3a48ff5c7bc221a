"""One request's state inside the engine, and what the engine hands back for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from afd_engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    """Invariant: tokens [0, num_cached) of prompt + output are in the KV cache; the rest are pending.

    A request samples its next token on the step that makes `num_cached == total_len`. Preemption
    drops the cache (num_cached = 0) and keeps the output, so recompute resumes where it stopped.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None  # page-table row while it holds KV pages
    prefix: object | None = None  # while running: its locked node of the prefix cache (radix_cache.Node)
    num_cached: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache when first admitted
    admitted: bool = False  # admitted once (a preempted request is admitted again)
    queued_round: int = 0  # the scheduling round it (re-)entered the waiting queue
    finish_reason: str | None = None
    error: str | None = None
    text_trim: int | None = None  # stop-string cut, as a character index into the output text
    num_preemptions: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per output token when params.logprobs is set

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        return self.total_len - self.num_cached

    @property
    def is_decode(self) -> bool:
        return self.num_cached > 0 and self.pending == 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(start - n, 0) : end - n]


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the `k` most likely alternatives, from the model's
    distribution before temperature and filtering."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class TokenUpdate:
    """What one step did to one request: the new token (if any) and whether it finished."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    error: str | None = None
    text_trim: int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass(frozen=True)
class RequestOutput:
    """The result of one request. `finish_reason` is "stop", "length", "abort" or "error"."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
