"""The response bodies of the generation routes, built from the engine's choices: OpenAI chat and
legacy completions (whole and streamed, with usage and logprobs; completions' echo), and the
native /generate in SGLang's layout."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from afd_engine.server import protocol as P
from afd_engine.server.choices import Choice
from afd_engine.server.state import ServerState


def usage(choices: list[Choice]) -> P.UsageInfo:
    """Each prompt counts once, however many choices it has; of its tokens, those its choices all
    found in the prefix cache count as cached."""
    by_prompt: dict[int, list[Choice]] = {}
    for c in choices:
        by_prompt.setdefault(id(c.prompt_ids), []).append(c)
    prompt = sum(len(cs[0].prompt_ids) for cs in by_prompt.values())
    cached = sum(min(c.num_cached_tokens for c in cs) for cs in by_prompt.values())
    return P.UsageInfo.of(prompt, sum(len(c.token_ids) for c in choices), cached)


# -- chat -------------------------------------------------------------------------------------


def _chat_logprobs(s: ServerState, c: Choice, token_ids: list[int], lps) -> P.ChatLogprobs | None:
    if c.params.logprobs is None:
        return None
    return s.logprob_format.chat_logprobs(token_ids, *P.LogprobFormatter.unpack(lps))


def chat_response(s: ServerState, body, choices: list[Choice]) -> P.ChatCompletionResponse:
    out = [
        P.ChatCompletionChoice(
            index=c.index,
            message=P.ChatResponseMessage(content=c.text),
            finish_reason=c.finish_reason,
            logprobs=_chat_logprobs(s, c, c.token_ids, c.logprobs),
        )
        for c in choices
    ]
    return P.ChatCompletionResponse(model=s.model_name, choices=out, usage=usage(choices))


async def chat_events(s: ServerState, body, choices: list[Choice], stream) -> AsyncIterator:
    rid = P.random_id("chatcmpl")

    def chunk(c: Choice, delta: P.DeltaMessage, finish=None, logprobs=None) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(
            id=rid,
            model=s.model_name,
            choices=[P.ChatCompletionStreamChoice(index=c.index, delta=delta, finish_reason=finish, logprobs=logprobs)],
        )

    plain = P.ChunkWriter("chat", rid, s.model_name)  # the chunks without logprobs
    for c in choices:
        yield plain.event(c.index, "", None, role=True)
    async for c, delta, update in stream:
        if delta or update.logprobs:
            lps = _chat_logprobs(s, c, update.token_ids, update.logprobs or [])
            yield (
                plain.event(c.index, delta, None)
                if lps is None
                else chunk(c, P.DeltaMessage(content=delta), logprobs=lps)
            )
        if update.finish_reason is not None:
            yield plain.event(c.index, None, c.finish_reason)
    if body.include_usage:
        yield P.ChatCompletionChunk(id=rid, model=s.model_name, choices=[], usage=usage(choices))


# -- completions ------------------------------------------------------------------------------


def _completion_logprobs(s: ServerState, c: Choice, token_ids, lps, offset: int):
    if c.params.logprobs is None:
        return None
    return s.logprob_format.completion_logprobs(token_ids, *P.LogprobFormatter.unpack(lps), text_offset=offset)


def _echo_text(s: ServerState, c: Choice) -> str:
    return s.tokenizer.decode(c.prompt_ids, skip_special_tokens=c.params.skip_special_tokens)


def _echo(s: ServerState, c: Choice) -> tuple[str, P.CompletionLogprobs | None]:
    """An echoed prompt: its text, and its tokens' logprobs when asked for (the first one null)."""
    return _echo_text(s, c), _completion_logprobs(s, c, c.prompt_ids, c.prompt_logprobs or [], 0)


def completion_response(s: ServerState, body, choices: list[Choice]) -> P.CompletionResponse:
    out = []
    for c in choices:
        tokens, lps, text = c.token_ids, c.logprobs, c.text
        if body.echo:
            tokens, lps = c.prompt_ids + tokens, (c.prompt_logprobs or []) + lps
            text = _echo_text(s, c) + text
        out.append(
            P.CompletionChoice(
                index=c.index,
                text=text,
                finish_reason=c.finish_reason,
                logprobs=_completion_logprobs(s, c, tokens, lps, 0),
            )
        )
    return P.CompletionResponse(model=s.model_name, choices=out, usage=usage(choices))


async def completion_events(s: ServerState, body, choices: list[Choice], stream) -> AsyncIterator:
    rid = P.random_id("cmpl")
    plain = P.ChunkWriter("completions", rid, s.model_name)  # the chunks without logprobs
    echoed: dict[int, int] = {}  # choice index -> characters of its echoed prompt
    async for c, delta, update in stream:
        if body.echo and c.index not in echoed:  # the prompt goes first, in a chunk of its own
            text, lps = _echo(s, c)
            echoed[c.index] = len(text)
            yield P.CompletionChunk(
                id=rid, model=s.model_name, choices=[P.CompletionChoice(index=c.index, text=text, logprobs=lps)]
            )
        if delta or update.finish_reason is not None or update.logprobs:
            finish = c.finish_reason if update.finish_reason else None
            if c.params.logprobs is None:
                yield plain.event(c.index, delta, finish)
                continue
            offset = echoed.get(c.index, 0) + len(c.text) - len(delta)
            lps = _completion_logprobs(s, c, update.token_ids, update.logprobs or [], offset)
            yield P.CompletionChunk(
                id=rid,
                model=s.model_name,
                choices=[
                    P.CompletionChoice(
                        index=c.index,
                        text=delta,
                        finish_reason=finish,
                        logprobs=lps,
                    )
                ],
            )
    if body.include_usage:
        yield P.CompletionChunk(id=rid, model=s.model_name, choices=[], usage=usage(choices))


# -- native -----------------------------------------------------------------------------------


def _sglang_logprobs(entries, token_ids: list[int]) -> tuple[list, list]:
    """SGLang's layout: [logprob, token id, null] per token, and per token its top alternatives."""
    tokens = [[e and e.logprob, t, None] for e, t in zip(entries, token_ids)]
    top = [e and [[lp, i, None] for i, lp in zip(e.top_ids, e.top_logprobs)] for e in entries]
    return tokens, top


def generate_response(s: ServerState, body, choices: list[Choice]) -> P.GenerateResponse:
    c = choices[0]
    meta = P.GenerateMetaInfo(
        finish_reason=c.finish_reason,
        prompt_tokens=len(c.prompt_ids),
        completion_tokens=len(c.token_ids),
        cached_tokens=c.num_cached_tokens,
        timeline=c.timeline,
    )
    if body.return_logprob:
        meta.output_token_logprobs, top = _sglang_logprobs(c.logprobs, c.token_ids)
        meta.output_top_logprobs = top if body.top_logprobs_num else None
        if body.logprob_start_len >= 0:
            scored = c.prompt_ids[min(body.logprob_start_len, len(c.prompt_ids)) :]
            meta.input_token_logprobs, top = _sglang_logprobs(c.prompt_logprobs or [], scored)
            meta.input_top_logprobs = top if body.top_logprobs_num else None
    return P.GenerateResponse(text=c.text, output_ids=c.token_ids, meta_info=meta)


async def generate_events(s: ServerState, body, choices: list[Choice], stream) -> AsyncIterator:
    async for c, delta, update in stream:
        meta = {"prompt_tokens": len(c.prompt_ids), "completion_tokens": len(c.token_ids)}
        meta["cached_tokens"] = c.num_cached_tokens
        if update.timeline is not None:
            meta["timeline"] = update.timeline
        event = {
            "text": delta,
            "output_ids": update.token_ids,
            "finish_reason": c.finish_reason if update.finish_reason else None,
            "meta_info": meta,
        }
        yield "data: " + json.dumps(event) + "\n\n"
