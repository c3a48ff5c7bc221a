"""One request's state inside the engine, and what the engine hands back for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from afd_engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    """Invariant: tokens [0, num_cached) of prompt + output are in the KV cache (or are written by
    a step already under way); the rest are pending.

    A request samples its next token on the step that makes `num_cached == total_len`. Preemption
    drops the cache (num_cached = 0) and keeps the output, so recompute resumes where it stopped.

    With overlapped scheduling a step is planned before the previous one has sampled: a token
    sampled by a step still under way counts in `total_len` but is not in `output_ids` yet; its
    value is a placeholder (see `tokens`) that the step resolves from its predecessor's samples.
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
    # with params.prompt_logprobs: one per prompt token from prompt_logprobs_start on, filled as
    # the prompt is computed (None for token 0, which nothing predicts)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    inflight: list[int] = field(default_factory=list)  # per token under way: its row in its step's samples
    # speculative decoding (runtime/spec_step.py): the draft tokens its next step verifies after
    # its newest token, and how many tokens its last step appended
    draft_ids: list[int] = field(default_factory=list)
    num_new: int = 1
    # prefill-decode disaggregation: the request's room (its id shared by both instances), the
    # prefill instance's bootstrap address (decode side), and durations for the TTFT split
    disagg_room: int | None = None
    disagg_bootstrap: str | None = None
    timeline: dict | None = None
    dest: dict | None = None  # prefill side: where its pages go (the decode rank's DEST message)
    sent_pages: int = 0  # prefill side: pages [0, sent_pages) are at the decode rank
    prefill_rank: str | None = None  # decode side: the prefill rank's address
    # `afd router` failover: output tokens another decode instance generated (and streamed) before
    # it was lost; they lead output_ids, and the request goes on from them as a preempted one would
    num_resumed: int = 0
    kv_pages: set[int] | None = None  # decode side: the pages reserved for the prefill side to fill
    # constrained decoding and penalties (runtime/logits_process.py): the compiled grammar, and
    # the state the forward thread advances with each token
    grammar: object | None = None
    matcher: object | None = None
    penalties: object | None = None

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] if self.params.prompt_logprobs_start == 0 else []

    @property
    def next_scored(self) -> int:
        """The next prompt token whose logprob is still to be recorded (the prompt's length: none)."""
        if self.prompt_logprobs is None:
            return len(self.prompt_ids)
        return min(self.params.prompt_logprobs_start + len(self.prompt_logprobs), len(self.prompt_ids))

    def cacheable_len(self) -> int:
        """How many leading tokens may come from the prefix cache: not the last one (it must be
        computed to sample from), nor any whose logits the prompt logprobs still need."""
        limit = self.total_len - 1
        if self.next_scored < len(self.prompt_ids):
            limit = min(limit, self.next_scored - 1)  # token i's logprob comes from position i - 1
        return limit

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + len(self.inflight)

    @property
    def known_len(self) -> int:
        """Tokens whose values are known (the prompt and the output appended so far)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def last_token_under_way(self, context_len: int) -> bool:
        """True when the token under way ends the request for sure (max_new_tokens or the context
        length): planning a step for it would compute a token nobody reads."""
        return bool(self.inflight) and (
            len(self.output_ids) + len(self.inflight) >= self.params.max_new_tokens or self.total_len >= context_len
        )

    @property
    def pending(self) -> int:
        return self.total_len - self.num_cached

    @property
    def is_decode(self) -> bool:
        return self.num_cached > 0 and self.pending == 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def newest_token(self) -> int:
        """The last token (a placeholder while under way): a decode step's input."""
        if self.inflight:
            return -1 - self.inflight[-1]
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output; a token still under way reads as the placeholder
        -(1 + its row in the previous step's samples)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        out = self.prompt_ids[start:] + self.output_ids[max(start - n, 0) : end - n]
        known = self.known_len
        if end > known:
            out += [-1 - row for row in self.inflight[max(start - known, 0) : end - known]]
        return out


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the `k` most likely alternatives, from the model's
    distribution before temperature and filtering."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)  # (not frozen: a frozen dataclass takes 5x longer to make, 0.5 ms per 256-request step)
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
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, in the first update after the prompt
    timeline: dict | None = None  # disaggregated requests: the TTFT split, with their first token


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
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token from the asked start
