"""Running the choices of one HTTP request through the engine, merged into one stream.

An OpenAI request becomes one engine request per (prompt, choice). Their updates arrive
interleaved; each is turned into a text delta by the choice's incremental detokenizer. When the
consumer stops early (client gone, error), every still-running engine request is aborted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from afd_engine.control.client import ControlClient
from afd_engine.runtime.request import TokenLogprob, TokenUpdate
from afd_engine.sampling_params import SamplingParams
from afd_engine.server.detokenizer import IncrementalDetokenizer
from afd_engine.server.metrics import ServerMetrics


@dataclass(eq=False)
class Choice:
    index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    last_token_at: float | None = None
    num_cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for, once the prompt is scored
    disaggregation: dict | None = None  # {"room": ...} of a request `afd router` sent
    timeline: dict | None = None  # disaggregated: the decode instance's TTFT split
    # with skip_special_tokens false: the EOS token id, whose text is left out of the output when it
    # ends the choice (it is the stop, not content; a tool-call parser would read it as text)
    hidden_eos: int | None = None
    # a request `afd router` resumes here: the text of the tokens the client had already
    resumed_text: str | None = None

    def resume(self, token_ids: list[int]) -> None:
        """Starts from tokens another decode instance streamed: they count as this choice's, and
        their text, which the client has, primes the detokenizer instead of being shown again."""
        self.token_ids += token_ids
        self.resumed_text = self.detok.add(token_ids)

    def absorb(self, update: TokenUpdate) -> str:
        """Takes one update; returns the text that became safe to show."""
        self.token_ids += update.token_ids
        self.logprobs += update.logprobs or []
        self.num_cached_tokens = update.num_cached_tokens
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        if update.timeline is not None:
            self.timeline = update.timeline
        shown = update.token_ids
        if update.finish_reason == "stop" and shown and shown[-1] == self.hidden_eos:
            shown = shown[:-1]
        delta = self.detok.add(shown)
        if update.finish_reason is not None:
            self.finish_reason = "stop" if update.finish_reason == "stop" else update.finish_reason
            delta += self.detok.finish(update.text_trim)
        return delta

    @property
    def text(self) -> str:
        return self.detok.text


def make_choices(
    tokenizer, rid: str, prompts: list[list[int]], params: list[SamplingParams], body=None
) -> list[Choice]:
    """n choices per prompt, indexed prompt-major as OpenAI does; `body` (the request) gives each
    its disaggregation room."""
    out = []
    for p, ids in enumerate(prompts):
        for c, sp in enumerate(params):
            index = p * len(params) + c
            detok = IncrementalDetokenizer(tokenizer, sp.skip_special_tokens, sp.stop)
            disaggregation = body.disaggregation(index) if body is not None else None
            eos = None if sp.skip_special_tokens else getattr(tokenizer, "eos_token_id", None)
            choice = Choice(index, f"{rid}-{index}", ids, sp, detok, disaggregation=disaggregation, hidden_eos=eos)
            if disaggregation is not None and "resume" in disaggregation:
                choice.resume(disaggregation["resume"])
            out.append(choice)
    return out


async def run_choices(
    client: ControlClient, choices: list[Choice], metrics: ServerMetrics, start: float
) -> AsyncIterator[tuple[Choice, str, TokenUpdate]]:
    """Yields (choice, text delta, update) as updates arrive from the engine. One choice (the
    usual request) reads its engine request's stream directly; several are merged through a
    queue, one task each."""
    if len(choices) == 1:
        choice = choices[0]
        updates = client.generate(choice.rid, choice.prompt_ids, choice.params, choice.disaggregation)
        try:
            async for update in updates:
                _observe(metrics, choice, update, start)
                yield choice, choice.absorb(update), update
        finally:  # closed early (client gone): the engine request is aborted now, not when collected
            await updates.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for update in client.generate(choice.rid, choice.prompt_ids, choice.params, choice.disaggregation):
                queue.put_nowait((choice, update))
        except Exception as exc:  # handed to the consumer, which raises it in the request's context
            queue.put_nowait((choice, exc))
        queue.put_nowait((choice, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            choice, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                _observe(metrics, choice, item, start)
                yield choice, choice.absorb(item), item
    finally:
        for t in tasks:
            t.cancel()  # a still-running choice is aborted in the engine by its generator


def _observe(metrics: ServerMetrics, choice: Choice, update: TokenUpdate, start: float) -> None:
    if not update.token_ids:
        return
    now = time.monotonic()
    if choice.last_token_at is None:
        metrics.ttft.observe(now - start)
    else:
        metrics.tpot.observe(now - choice.last_token_at)
    choice.last_token_at = now
    metrics.generation_tokens.inc(len(update.token_ids))
    if update.timeline is not None:
        metrics.kv_transfer_seconds.observe(update.timeline["transfer_s"])
