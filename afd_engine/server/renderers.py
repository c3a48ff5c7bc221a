"""The response bodies of the generation routes, built from the engine's choices: OpenAI chat and
legacy completions (whole and streamed, with usage and logprobs; completions' echo), and the
native /generate in SGLang's layout."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from afd_engine.server import protocol as P
from afd_engine.server.choices import Choice
from afd_engine.server.state import ServerState
from afd_engine.server.tool_calls import ToolCallStream, parse_tool_calls


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


def _tool_finish(finish_reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's finish reason of a turn that ended after making tool calls."""
    return "tool_calls" if made_calls and finish_reason == "stop" else finish_reason


def _chat_message(body, c: Choice) -> tuple[P.ChatResponseMessage, str | None]:
    """The assistant message of a choice (tool calls parsed out when the request has tools) and
    its finish reason."""
    if not body.active_tools():
        return P.ChatResponseMessage(content=c.text), c.finish_reason
    content, calls = parse_tool_calls(body.tool_parser, c.text)
    if not calls:
        return P.ChatResponseMessage(content=c.text), c.finish_reason
    tool_calls = [P.ToolCallOut(function=P.ToolCallFunction(name=t.name, arguments=t.arguments)) for t in calls]
    return P.ChatResponseMessage(content=content, tool_calls=tool_calls), _tool_finish(c.finish_reason, True)


def chat_response(s: ServerState, body, choices: list[Choice]) -> P.ChatCompletionResponse:
    out = []
    for c in choices:
        message, finish = _chat_message(body, c)
        out.append(
            P.ChatCompletionChoice(
                index=c.index,
                message=message,
                finish_reason=finish,
                logprobs=_chat_logprobs(s, c, c.token_ids, c.logprobs),
            )
        )
    return P.ChatCompletionResponse(model=s.model_name, choices=out, usage=usage(choices))


def _stream_id(body, prefix: str) -> str:
    """A new stream's id; a stream `afd router` resumes here keeps the id its chunks had."""
    if body.resumed and body.afd_resume.id:
        return body.afd_resume.id
    return P.random_id(prefix)


async def chat_events(s: ServerState, body, choices: list[Choice], stream) -> AsyncIterator:
    """The chat stream's events, the events of one update written as one piece (`afd router`
    reads a stream's token ids beside them: server/stream_ids.py)."""
    rid = _stream_id(body, "chatcmpl")

    def chunk(c: Choice, delta: P.DeltaMessage, finish=None, logprobs=None) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(
            id=rid,
            model=s.model_name,
            choices=[P.ChatCompletionStreamChoice(index=c.index, delta=delta, finish_reason=finish, logprobs=logprobs)],
        )

    plain = P.ChunkWriter("chat", rid, s.model_name)  # the chunks without logprobs
    for c in choices if not body.resumed else ():  # (a resumed stream's client has them)
        yield plain.event(c.index, "", None, role=True)
    events = _tool_call_events if body.active_tools() else _content_events
    async for event in events(s, body, stream, chunk, plain):
        yield event
    if body.include_usage:
        yield P.ChatCompletionChunk(id=rid, model=s.model_name, choices=[], usage=usage(choices))


async def _content_events(s: ServerState, body, stream, chunk, plain) -> AsyncIterator:
    """A chat stream's text as content deltas (with their logprobs when asked for)."""
    async for c, delta, update in stream:
        out = []
        if delta or update.logprobs:
            lps = _chat_logprobs(s, c, update.token_ids, update.logprobs or [])
            out.append(
                plain.event(c.index, delta, None)
                if lps is None
                else P.sse_event(chunk(c, P.DeltaMessage(content=delta), logprobs=lps))
            )
        if update.finish_reason is not None:
            out.append(plain.event(c.index, None, c.finish_reason))
        if out:
            yield "".join(out)


async def _tool_call_events(s: ServerState, body, stream, chunk, plain) -> AsyncIterator:
    """A chat stream whose text is parsed for tool calls as it comes: content goes out as content
    deltas, each call as a delta with its id and name and then its arguments; a possible start of
    a call is held back until it is decided."""
    parsers: dict[int, ToolCallStream] = {}
    made: dict[int, int] = {}  # choice index -> calls sent

    def events(c: Choice, pieces) -> list[str]:
        out = []
        for piece in pieces:
            if piece.content is not None:
                out.append(plain.event(c.index, piece.content, None))
                continue
            if piece.name is not None:
                made[c.index] = made.get(c.index, 0) + 1
                call = P.DeltaToolCall(
                    index=piece.index,
                    id=P.random_id("call"),
                    type="function",
                    function=P.DeltaFunction(name=piece.name, arguments=""),
                )
            else:
                call = P.DeltaToolCall(index=piece.index, function=P.DeltaFunction(arguments=piece.arguments))
            out.append(P.sse_event(chunk(c, P.DeltaMessage(tool_calls=[call]))))
        return out

    def parser_of(c: Choice) -> ToolCallStream:
        parser = parsers.get(c.index)
        if parser is None:
            parser = parsers[c.index] = ToolCallStream(body.tool_parser)
            if c.resumed_text:  # the text the client has: parsed again, its calls counted, nothing sent
                events(c, parser.feed(c.resumed_text))
        return parser

    async for c, delta, update in stream:
        parser = parser_of(c)
        out = events(c, parser.feed(delta) if delta else [])
        if update.logprobs:
            lps = _chat_logprobs(s, c, update.token_ids, update.logprobs)
            if lps is not None:
                out.append(P.sse_event(chunk(c, P.DeltaMessage(), logprobs=lps)))
        if update.finish_reason is not None:
            out += events(c, parser.finish())
            out.append(plain.event(c.index, None, _tool_finish(c.finish_reason, made.get(c.index, 0) > 0)))
        if out:
            yield "".join(out)


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
    """The completion stream's events, one update's written as one piece (see chat_events)."""
    rid = _stream_id(body, "cmpl")
    plain = P.ChunkWriter("completions", rid, s.model_name)  # the chunks without logprobs
    echoed: dict[int, int] = {}  # choice index -> characters of its echoed prompt
    async for c, delta, update in stream:
        out = []
        if body.echo and c.index not in echoed and body.resumed:  # (the client has the prompt)
            echoed[c.index] = len(_echo_text(s, c))
        if body.echo and c.index not in echoed:  # the prompt goes first, in a chunk of its own
            text, lps = _echo(s, c)
            echoed[c.index] = len(text)
            chunk = P.CompletionChunk(
                id=rid, model=s.model_name, choices=[P.CompletionChoice(index=c.index, text=text, logprobs=lps)]
            )
            out.append(P.sse_event(chunk))
        if delta or update.finish_reason is not None or update.logprobs:
            finish = c.finish_reason if update.finish_reason else None
            if c.params.logprobs is None:
                out.append(plain.event(c.index, delta, finish))
            else:
                offset = echoed.get(c.index, 0) + len(c.text) - len(delta)
                lps = _completion_logprobs(s, c, update.token_ids, update.logprobs or [], offset)
                choice = P.CompletionChoice(index=c.index, text=delta, finish_reason=finish, logprobs=lps)
                out.append(P.sse_event(P.CompletionChunk(id=rid, model=s.model_name, choices=[choice])))
        if out:
            yield "".join(out)
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
