"""The OpenAI-compatible HTTP API (FastAPI). Tokenizes, forwards to the engine, detokenizes.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /generate (native, token ids),
GET /v1/models, GET /health, GET /metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from afd_engine.errors import AFDError
from afd_engine.server import protocol as P
from afd_engine.server.choices import Choice, make_choices, run_choices
from afd_engine.server.engine_client import EngineClient, EngineUnavailable
from afd_engine.control.loop import ControlAddrs
from afd_engine.server.errors import APIError, error_body, install_exception_handlers, invalid_api_key, server_error
from afd_engine.server.metrics import ServerMetrics

DISCONNECT_POLL_S = 0.25
log = logging.getLogger("afd.serve")


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: object
    model_name: str
    context_len: int
    default_max_tokens: int
    metrics: ServerMetrics
    logprob_format: P.LogprobFormatter


def build_app(model_path: str, model_name: str, server_args, start_ranks: Callable[[], dict], addrs: ControlAddrs,
              num_ranks: int = 1, alive: Callable[[], bool] = lambda: True) -> FastAPI:
    """The app; at startup it binds the control sockets, then `start_ranks()` brings the engine up
    (the port opens only once every rank is ready)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    holder: dict[str, ServerState] = {}

    @asynccontextmanager
    async def lifespan(_app):
        client = EngineClient(addrs, num_ranks, alive)
        try:
            info = start_ranks()
        except AFDError as exc:
            log.error("%s", exc)
            raise
        client.start()
        holder["s"] = ServerState(client, tokenizer, model_name, info["context_len"], server_args.default_max_tokens,
                                  ServerMetrics(), P.LogprobFormatter(tokenizer))
        _banner(server_args, model_name)
        yield
        await client.shutdown()

    app = FastAPI(title="afd-engine", lifespan=lifespan)
    install_exception_handlers(app)
    _install_auth(app, server_args.api_key)

    @app.exception_handler(EngineUnavailable)
    async def _engine_down(_request, exc):
        return server_error(f"the engine is unavailable: {exc}", status=503)

    _routes(app, lambda: holder["s"])
    return app


def _banner(server_args, name: str) -> None:
    base = f"http://{server_args.host}:{server_args.port}"
    auth = f' -H "Authorization: Bearer {server_args.api_key}"' if server_args.api_key else ""
    if "random" in name:
        log.warning("serving the embedded tiny model %s: RANDOM WEIGHTS, its text is noise", name)
    log.info("ready; try:\n  curl %s/v1/chat/completions -H 'Content-Type: application/json'%s "
             "-d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], "
             "\"max_tokens\": 16}'", base, auth, name)


def _install_auth(app: FastAPI, api_key: str | None) -> None:
    if not api_key:
        return

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if request.url.path.startswith("/v1/") and request.headers.get("authorization") != f"Bearer {api_key}":
            return invalid_api_key()
        return await call_next(request)


def _routes(app: FastAPI, state: Callable[[], ServerState]) -> None:
    @app.get("/health")
    async def health():
        ok = state().client.healthy
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        s = state()
        return Response(s.metrics.render(s.client.stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return P.ModelList(data=[P.ModelCard(id=state().model_name)])

    @app.post("/v1/chat/completions")
    async def chat(body: P.ChatCompletionRequest, request: Request):
        s = state()
        _check_model(s, body.model)
        ids = list(s.tokenizer.apply_chat_template(body.template_messages(), add_generation_prompt=True,
                                                   tokenize=True)["input_ids"])
        return await _serve(s, request, body, [ids], "chat")

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        s = state()
        _check_model(s, body.model)
        prompts = [p if isinstance(p, list) else s.tokenizer.encode(p) for p in body.prompts()]
        return await _serve(s, request, body, prompts, "completions")

    @app.post("/generate")
    async def generate(body: P.GenerateRequest, request: Request):
        s = state()
        ids = body.input_ids if body.input_ids is not None else s.tokenizer.encode(body.text)
        return await _serve(s, request, body, [ids], "generate")


def _check_model(s: ServerState, model: str) -> None:
    if model != s.model_name:
        raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")


async def _serve(s: ServerState, request: Request, body, prompts: list[list[int]], endpoint: str):
    params = body.choice_sampling_params(_max_tokens_left(s, prompts)) if endpoint != "generate" else \
        [body.to_sampling_params(_max_tokens_left(s, prompts))]
    _check_lengths(s, prompts, params[0].max_new_tokens)
    choices = make_choices(s.tokenizer, P.random_id("req"), prompts, params)
    start = time.monotonic()
    stream = run_choices(s.client, choices, s.metrics, start)
    s.metrics.prompt_tokens.inc(sum(len(p) for p in prompts) * len(params))
    if getattr(body, "stream", False):
        s.metrics.requests.labels(endpoint, "stream").inc()
        events = {"chat": _chat_events, "completions": _completion_events, "generate": _generate_events}[endpoint]
        return StreamingResponse(_sse(events(s, body, choices, stream)), media_type="text/event-stream")
    done = await _until_done_or_disconnect(request, _drain(stream))
    if done is None:
        s.metrics.requests.labels(endpoint, "aborted").inc()
        return Response(status_code=499)
    s.metrics.requests.labels(endpoint, "ok").inc()
    return {"chat": _chat_response, "completions": _completion_response, "generate": _generate_response}[endpoint](
        s, choices)


def _max_tokens_left(s: ServerState, prompts: list[list[int]]) -> int:
    return max(1, min(s.default_max_tokens, s.context_len - max(len(p) for p in prompts)))


def _check_lengths(s: ServerState, prompts: list[list[int]], max_new: int) -> None:
    for p in prompts:
        if len(p) == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(p) + max_new > s.context_len:
            raise APIError(400, f"This model's maximum context length is {s.context_len} tokens. However, you "
                                f"requested {len(p) + max_new} tokens ({len(p)} in the prompt, {max_new} for the "
                                "completion). Please reduce the prompt or the completion length.",
                           param="max_tokens", code="context_length_exceeded")


async def _drain(stream: AsyncIterator) -> bool:
    async for _ in stream:
        pass
    return True


async def _until_done_or_disconnect(request: Request, work: Awaitable):
    """Runs `work`; if the client goes away first, cancels it (which aborts the engine requests)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            return None


async def _sse(events: AsyncIterator) -> AsyncIterator[str]:
    """Server-sent events; a failure midway (the engine died) ends the stream with an OpenAI
    error event, which clients raise as an error instead of seeing a silent cut."""
    try:
        async for event in events:
            yield event if isinstance(event, str) else P.sse_event(event)
    except AFDError as exc:
        log.error("stream failed: %s", exc)
        body = error_body(f"the engine is unavailable: {exc}", type="server_error")
        yield f"data: {json.dumps(body)}\n\n"
    yield P.SSE_DONE


def _usage(choices: list[Choice]) -> P.UsageInfo:
    prompt = sum(len(p) for p in {id(c.prompt_ids): c.prompt_ids for c in choices}.values())
    return P.UsageInfo.of(prompt, sum(len(c.token_ids) for c in choices))


# -- chat -------------------------------------------------------------------------------------

def _chat_logprobs(s: ServerState, c: Choice, token_ids: list[int], lps) -> P.ChatLogprobs | None:
    if c.params.logprobs is None:
        return None
    return s.logprob_format.chat_logprobs(token_ids, [lp.logprob for lp in lps],
                                          [(lp.top_ids, lp.top_logprobs) for lp in lps])


def _chat_response(s: ServerState, choices: list[Choice]) -> P.ChatCompletionResponse:
    out = [P.ChatCompletionChoice(index=c.index, message=P.ChatResponseMessage(content=c.text),
                                  finish_reason=c.finish_reason, logprobs=_chat_logprobs(s, c, c.token_ids, c.logprobs))
           for c in choices]
    return P.ChatCompletionResponse(model=s.model_name, choices=out, usage=_usage(choices))


async def _chat_events(s: ServerState, body, choices: list[Choice], stream) -> AsyncIterator:
    rid = P.random_id("chatcmpl")

    def chunk(c: Choice, delta: P.DeltaMessage, finish=None, logprobs=None) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(id=rid, model=s.model_name, choices=[
            P.ChatCompletionStreamChoice(index=c.index, delta=delta, finish_reason=finish, logprobs=logprobs)])

    for c in choices:
        yield chunk(c, P.DeltaMessage(role="assistant", content=""))
    async for c, delta, update in stream:
        if delta or update.logprobs:
            lps = _chat_logprobs(s, c, update.token_ids, update.logprobs or [])
            yield chunk(c, P.DeltaMessage(content=delta), logprobs=lps)
        if update.finish_reason is not None:
            yield chunk(c, P.DeltaMessage(), finish=c.finish_reason)
    if body.include_usage:
        yield P.ChatCompletionChunk(id=rid, model=s.model_name, choices=[], usage=_usage(choices))


# -- completions ------------------------------------------------------------------------------

def _completion_logprobs(s: ServerState, c: Choice, token_ids, lps, offset: int):
    if c.params.logprobs is None:
        return None
    return s.logprob_format.completion_logprobs(token_ids, [lp.logprob for lp in lps],
                                                [(lp.top_ids, lp.top_logprobs) for lp in lps], text_offset=offset)


def _completion_response(s: ServerState, choices: list[Choice]) -> P.CompletionResponse:
    out = [P.CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                              logprobs=_completion_logprobs(s, c, c.token_ids, c.logprobs, 0)) for c in choices]
    return P.CompletionResponse(model=s.model_name, choices=out, usage=_usage(choices))


async def _completion_events(s: ServerState, body, choices: list[Choice], stream) -> AsyncIterator:
    rid = P.random_id("cmpl")
    async for c, delta, update in stream:
        if delta or update.finish_reason is not None or update.logprobs:
            offset = len(c.text) - len(delta)
            lps = _completion_logprobs(s, c, update.token_ids, update.logprobs or [], offset)
            yield P.CompletionChunk(id=rid, model=s.model_name, choices=[
                P.CompletionChoice(index=c.index, text=delta, finish_reason=c.finish_reason if update.finish_reason
                                   else None, logprobs=lps)])
    if body.include_usage:
        yield P.CompletionChunk(id=rid, model=s.model_name, choices=[], usage=_usage(choices))


# -- native -----------------------------------------------------------------------------------

def _generate_response(s: ServerState, choices: list[Choice]) -> dict:
    c = choices[0]
    return {"text": c.text, "output_ids": c.token_ids,
            "meta_info": {"finish_reason": c.finish_reason, "prompt_tokens": len(c.prompt_ids),
                          "completion_tokens": len(c.token_ids)}}


async def _generate_events(s: ServerState, body, choices: list[Choice], stream) -> AsyncIterator:
    async for c, delta, update in stream:
        yield "data: " + json.dumps({"text": delta, "output_ids": update.token_ids,
                                     "finish_reason": c.finish_reason if update.finish_reason else None}) + "\n\n"


__all__ = ["build_app", "EngineUnavailable"]
