"""The OpenAI-compatible HTTP API (FastAPI). Tokenizes, forwards to the engine, detokenizes.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /generate (native, token ids),
GET /v1/models, GET /health, GET /metrics, GET /expert_load (admin.py). On SIGTERM the server
drains (drain.py): the generation routes answer 503 and /health "draining" while those in flight end.

The boundary is hardened in layers: a body over ``--max-request-bytes`` is refused before it is
parsed; the schema (protocol.py) refuses invalid Unicode and unsupported fields; text over
``--max-prompt-chars`` is refused before it reaches the tokenizer; tokenization and chat-template
rendering run in a worker thread, so a long prompt does not stall the event loop (and with it
every other client's stream). Every error, FastAPI's own included, is OpenAI's error JSON.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST

from afd_engine.control.client import ControlClient, EngineUnavailable
from afd_engine.control.load_balance import LoadBalancer
from afd_engine.control.loop import ControlAddrs
from afd_engine.errors import AFDError, InvalidRequestError
from afd_engine.runtime.grammar import check_guide
from afd_engine.sampling_params import SamplingParams
from afd_engine.server import protocol as P
from afd_engine.server import renderers as R
from afd_engine.server.admin import admin_routes
from afd_engine.server.auth import install_auth
from afd_engine.server.choices import make_choices, run_choices
from afd_engine.server.drain import Drain, DrainGate
from afd_engine.server.errors import (
    APIError,
    error_body,
    error_responses,
    install_exception_handlers,
    invalid_api_key,
    openai_error,
    server_error,
    without_422,
)
from afd_engine.server.metrics import ServerMetrics
from afd_engine.server.state import ServerState
from afd_engine.server.stream_ids import with_token_ids
from afd_engine.server.tool_calls import default_tool_messages, template_supports_tools

DISCONNECT_POLL_S = 0.25
log = logging.getLogger("afd.serve")


def build_app(
    model_path: str,
    model_name: str,
    server_args,
    start_ranks: Callable[[], dict],
    addrs: ControlAddrs,
    router: LoadBalancer,
    alive: Callable[[], bool] = lambda: True,
    engine_args=None,
    lost_ranks: Callable[[], set[int]] | None = None,
    replace: Callable[[int], dict] | None = None,
) -> FastAPI:
    """The app; at startup it binds the control sockets, then `start_ranks()` brings the engine up
    (the port opens only once every rank is ready). `router` picks each request's attention rank.
    A prefill instance (`engine_args.disaggregation_mode`) also runs its bootstrap server.
    `lost_ranks()` and `replace(rank)` (fault tolerance): the attention ranks whose process
    exited, and how one is replaced (ControlClient)."""
    mode = engine_args.disaggregation_mode if engine_args is not None else "null"
    from afd_engine.checkpoint_tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    holder: dict[str, ServerState] = {}
    drain = Drain(server_args.drain_timeout, log)

    @asynccontextmanager
    async def lifespan(_app):
        record = engine_args.record_steps if engine_args is not None else None
        client = ControlClient(
            addrs,
            router,
            alive,
            route_by_room=mode == "prefill",
            lost_ranks=lost_ranks,
            replace=replace,
            record=f"{record}.frontend.jsonl" if record else None,
        )
        try:
            info = start_ranks()
            bootstrap = _bootstrap_server(engine_args, info) if mode == "prefill" else None
        except AFDError as exc:
            log.error("%s", exc)
            raise
        client.start()
        metrics = ServerMetrics()
        metrics.draining.set_function(lambda: float(drain.draining))
        holder["s"] = ServerState(
            client,
            tokenizer,
            model_name,
            info["context_len"],
            server_args.default_max_tokens,
            metrics,
            P.LogprobFormatter(tokenizer),
            server_args.max_prompt_chars,
            P.generation_defaults(model_path),
            info.get("vocab_size") or len(tokenizer),
            _tool_call_parser(server_args, info.get("architecture", "")),
            mode,
            engine_args.disaggregation_bootstrap_port if mode == "prefill" else None,
        )
        _banner(server_args, model_name)
        yield
        await client.shutdown()
        if bootstrap is not None:
            bootstrap.close()

    app = FastAPI(title="afd-engine", lifespan=lifespan)
    install_exception_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=server_args.max_request_bytes)
    # added last, so it runs first: no body is read for a request without the key
    install_auth(app, server_args.api_keys(), server_args.metrics_require_key, invalid_api_key)
    # outermost: during the drain a generation request is refused before anything reads it
    app.add_middleware(DrainGate, drain=drain)
    app.state.drain = drain  # (the HTTP server starts it on SIGTERM: serve.py)
    schema = app.openapi
    app.openapi = lambda: without_422(schema())

    @app.exception_handler(EngineUnavailable)
    async def _engine_down(_request, exc):
        return server_error(f"the engine is unavailable: {exc}", status=503)

    _routes(app, lambda: holder["s"], drain)
    admin_routes(app, lambda: holder["s"])
    return app


def _bootstrap_server(engine_args, info: dict):
    from afd_engine.disagg.bootstrap import BootstrapServer

    return BootstrapServer(
        engine_args.disaggregation_host,
        engine_args.disaggregation_bootstrap_port,
        info["disagg_ranks"],
        info["disagg_description"],
    )


def _banner(server_args, name: str) -> None:
    base = f"{'https' if server_args.ssl_certfile else 'http'}://{server_args.host}:{server_args.port}"
    auth = ' -H "Authorization: Bearer $AFD_API_KEY"' if server_args.api_keys() else ""  # never the key itself
    if "random" in name:
        log.warning("serving the embedded tiny model %s: RANDOM WEIGHTS, its text is noise", name)
    log.info(
        "ready; try:\n  curl %s/v1/chat/completions -H 'Content-Type: application/json'%s "
        '-d \'{"model": "%s", "messages": [{"role": "user", "content": "Hello"}], '
        '"max_tokens": 16}\'',
        base,
        auth,
        name,
    )


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is a 413 before anything parses it.

    A declared Content-Length is checked up front; a chunked body is counted as it arrives. The
    body is read here (FastAPI would read it whole anyway) and replayed to the app, after which
    the app's ``receive`` is the connection's again, so disconnects are still seen.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, scope, receive, send) -> None:
        response = openai_error(
            413,
            f"The request body is larger than this server's limit of {self.max_bytes} bytes (--max-request-bytes).",
            code="request_too_large",
        )
        await response(scope, receive, send)


# Documented responses: a generation route answers JSON, or server-sent events with "stream": true.
# Before OpenAPI 3.2, an event stream's schema describes one event (as schemathesis reads it too).
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "one JSON chunk; the last event's data is [DONE]"}},
}
_SSE = {200: {"content": {"text/event-stream": {"schema": _SSE_EVENT}}}}
_GENERATION_ERRORS = error_responses(400, 404, 413, 503)


def _routes(app: FastAPI, state: Callable[[], ServerState], drain: Drain) -> None:
    @app.get(
        "/health",
        response_model=P.HealthStatus,
        responses={503: {"model": P.HealthStatus, "description": "The engine is not running, or the server drains"}},
    )
    async def health():
        if drain.draining:  # a readiness probe takes the server out of its load balancer
            return drain.health()
        ok = state().client.healthy
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text exposition format"}},
    )
    async def metrics():
        s = state()
        alive, resumed = s.client.attention_ranks_alive, s.client.resumed
        return Response(s.metrics.render(s.client.stats, alive, resumed), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def server_info():
        """What `afd router` asks an instance: its model, context length and disaggregation role."""
        s = state()
        return {
            "model": s.model_name,
            "context_len": s.context_len,
            "disaggregation_mode": s.disaggregation_mode,
            "bootstrap_port": s.bootstrap_port,
        }

    @app.get("/v1/models", response_model=P.ModelList, responses=error_responses(401))
    async def models():
        return P.ModelList(data=[P.ModelCard(id=state().model_name)])

    @app.post(
        "/v1/chat/completions",
        response_model=P.ChatCompletionResponse,
        responses={**_GENERATION_ERRORS, **error_responses(401), **_SSE},
    )
    async def chat(body: P.ChatCompletionRequest, request: Request):
        s = state()
        _check_model(s, body.model)
        _check_prompt_chars(s, body.text_chars(), "messages")
        body.with_tool_parser(s.tool_call_parser)
        return await _serve(s, request, body, [await _render_chat(s, body)], "chat")

    @app.post(
        "/v1/completions",
        response_model=P.CompletionResponse,
        responses={**_GENERATION_ERRORS, **error_responses(401), **_SSE},
    )
    async def completions(body: P.CompletionRequest, request: Request):
        s = state()
        _check_model(s, body.model)
        _check_prompt_chars(s, body.text_chars(), "prompt")
        prompts = await asyncio.to_thread(
            lambda: [p if isinstance(p, list) else s.tokenizer.encode(p) for p in body.prompts()]
        )
        return await _serve(s, request, body, prompts, "completions")

    @app.post(
        "/generate",
        response_model=P.GenerateResponse,
        response_model_exclude_none=True,  # the logprob fields only when asked for
        responses={**error_responses(400, 413, 503), **_SSE},
    )
    async def generate(body: P.GenerateRequest, request: Request):
        s = state()
        _check_prompt_chars(s, body.text_chars(), "text")
        ids = body.input_ids if body.input_ids is not None else await asyncio.to_thread(s.tokenizer.encode, body.text)
        return await _serve(s, request, body, [ids], "generate")


def _tool_call_parser(server_args, architecture: str) -> str:
    """--tool-call-parser, or for auto the format of the checkpoint's family."""
    parser = getattr(server_args, "tool_call_parser", "auto")
    if parser != "auto":
        return parser
    return "qwen25" if architecture.lower().startswith("qwen") else "deepseekv3"


def _check_model(s: ServerState, model: str) -> None:
    if model != s.model_name:
        raise APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")


def _check_prompt_chars(s: ServerState, chars: int, param: str) -> None:
    if chars > s.max_prompt_chars:
        raise APIError(
            400,
            f"The request has {chars} characters of prompt text; this server accepts at most "
            f"{s.max_prompt_chars} (--max-prompt-chars).",
            param=param,
        )


async def _render_chat(s: ServerState, body: P.ChatCompletionRequest) -> list[int]:
    """The prompt's token ids through the model's chat template, in a worker thread.

    Tools go to a template that renders them; for one that cannot, the conversation is rewritten
    in the documented default form (server/tool_calls/prompts.py: default_tool_messages).
    A template refuses what it cannot render (a role it does not know, turns out of order) by
    raising; that is the client's request, so it is a 400 quoting the template's reason.
    """
    messages, tools = body.template_messages(), body.active_tools()
    kwargs = {}
    uses_tools = tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if uses_tools and template_supports_tools(_template_text(s.tokenizer)):
        kwargs["tools"] = tools
    elif uses_tools:
        messages = default_tool_messages(s.tool_call_parser, messages, tools)
    try:
        encoded = await asyncio.to_thread(
            s.tokenizer.apply_chat_template, messages, add_generation_prompt=True, tokenize=True, **kwargs
        )
    except TemplateError as exc:
        raise APIError(400, f"The model's chat template cannot render these messages: {exc}", param="messages") from exc
    return list(encoded["input_ids"])


def _template_text(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one, or the tool-use one
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else None


async def _serve(s: ServerState, request: Request, body, prompts: list[list[int]], endpoint: str):
    params = (
        body.choice_sampling_params(_max_tokens_left(s, prompts), s.sampling_defaults)
        if endpoint != "generate"
        else [body.to_sampling_params(_max_tokens_left(s, prompts), s.sampling_defaults)]
    )
    _check_lengths(s, prompts, params[0].max_new_tokens)
    await _check_processing(s, body, params[0])
    choices = make_choices(s.tokenizer, P.random_id("req"), prompts, params, body)
    start = time.monotonic()
    stream = run_choices(s.client, choices, s.metrics, start)
    s.metrics.prompt_tokens.inc(sum(len(p) for p in prompts) * len(params))
    if getattr(body, "stream", False):
        s.metrics.requests.labels(endpoint, "stream").inc()
        events = {"chat": R.chat_events, "completions": R.completion_events, "generate": R.generate_events}[endpoint]
        aborted = s.metrics.requests.labels(endpoint, "aborted").inc
        render = functools.partial(events, s, body, choices)
        # (`afd router` asks for each update's token ids beside its events: server/stream_ids.py)
        sse = _sse(with_token_ids(render, stream) if body.afd_token_ids else render(stream), aborted, stream)
        return StreamingResponse(sse, media_type="text/event-stream")
    done = await _until_done_or_disconnect(request, _drain(stream))
    if done is None:
        s.metrics.requests.labels(endpoint, "aborted").inc()
        return Response(status_code=499)
    s.metrics.requests.labels(endpoint, "ok").inc()
    return {"chat": R.chat_response, "completions": R.completion_response, "generate": R.generate_response}[endpoint](
        s, body, choices
    )


def _max_tokens_left(s: ServerState, prompts: list[list[int]]) -> int:
    return max(1, min(s.default_max_tokens, s.context_len - max(len(p) for p in prompts)))


def _check_lengths(s: ServerState, prompts: list[list[int]], max_new: int) -> None:
    for p in prompts:
        if len(p) == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(p) + max_new > s.context_len:
            raise APIError(
                400,
                f"This model's maximum context length is {s.context_len} tokens. However, you "
                f"requested {len(p) + max_new} tokens ({len(p)} in the prompt, {max_new} for the "
                "completion). Please reduce the prompt or the completion length.",
                param="max_tokens",
                code="context_length_exceeded",
            )


async def _check_processing(s: ServerState, body, params: SamplingParams) -> None:
    """400s for what only the model knows: logit_bias ids past its vocabulary, a guide that does
    not build into a grammar (checked in a worker thread; repeated guides from a cache)."""
    bad = max((t for t, _ in params.logit_bias), default=-1)
    if bad >= s.vocab_size:
        param = "sampling_params.logit_bias" if isinstance(body, P.GenerateRequest) else "logit_bias"
        raise APIError(400, f"logit_bias token id {bad} is outside the vocabulary (size {s.vocab_size})", param=param)
    guide = body.guide()
    if guide is not None:
        (kind, spec), param = guide
        error = await asyncio.to_thread(_guide_error, kind, spec, param)
        if error is not None:
            raise APIError(400, error, param=param)


@functools.lru_cache(maxsize=256)
def _guide_error(kind: str, spec: str, param: str) -> str | None:
    try:
        check_guide(kind, spec, param)
    except InvalidRequestError as exc:
        return str(exc)
    return None


async def _drain(stream: AsyncIterator) -> bool:
    async for _ in stream:
        pass
    return True


async def _until_done_or_disconnect(request: Request, work: Awaitable):
    """Runs `work`; if the client goes away first, cancels it (which aborts the engine requests)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                return None
    except asyncio.CancelledError:  # the request itself was cut (drain timeout): so is its work
        task.cancel()
        raise


async def _sse(events: AsyncGenerator, on_abort: Callable[[], None], choices: AsyncGenerator) -> AsyncIterator[str]:
    """Server-sent events; a failure midway (the engine died) ends the stream with an OpenAI
    error event, which clients raise as an error instead of seeing a silent cut.

    A stream closed before its end (the client went away) calls `on_abort` and closes `events`
    and the `choices` stream it reads, which aborts the engine requests at once: an async
    generator left suspended is only closed when the garbage collector finds it, seconds later,
    and its requests would hold their KV pages until then."""
    ended = False
    try:
        try:
            async for event in events:
                yield event if isinstance(event, str) else P.sse_event(event)
        except AFDError as exc:
            log.error("stream failed: %s", exc)
            body = error_body(f"the engine is unavailable: {exc}", type="server_error")
            yield f"data: {json.dumps(body)}\n\n"
        yield P.SSE_DONE
        ended = True
    finally:
        if not ended:
            on_abort()
            await events.aclose()
            await choices.aclose()


__all__ = ["build_app", "EngineUnavailable"]
