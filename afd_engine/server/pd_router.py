"""`afd router`: the OpenAI-compatible front of a prefill-decode disaggregated deployment.

    client --> router --(request + bootstrap_room)-----------------------> prefill instance
                      --(request + room + the prefill's bootstrap address)-> decode instance
                      <------------------- tokens (stream or JSON) ------- decode instance

Per request the router picks a prefill instance (cache-aware: the one it last sent the longest
prefix of this prompt's text, unless much busier) and a decode instance (the fewest requests in
flight), sends both the same request under one random room id, and relays the decode instance's
answer. The prefill instance's answer only says whether it did its part: a prefill instance
that fails or goes away fails the request (an OpenAI error, or an error event in a stream) and
the decode request is closed, which frees its pages; a client that goes away closes both.

Conditional disaggregation (--local-prefill-max-tokens N, with --tokenizer): a request whose
prompt has at most N tokens goes to the decode instance alone, which prefills it itself. A short
prompt's prefill costs a decode batch little, and it skips the queue behind long prompts on the
prefill instance and the KV transfer; long prompts still prefill on the prefill instance.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from afd_engine.control.load_balance import CacheAwareBalancer
from afd_engine.errors import ConfigError
from afd_engine.server.auth import install_auth, resolve_keys, tls_settings
from afd_engine.server.errors import error_body, invalid_api_key, openai_error

log = logging.getLogger("afd.router")
ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
ROOM_STRIDE = 1 << 16  # rooms room .. room + STRIDE - 1 name the request's choices (n x prompts)
PREFIX_BLOCK_BYTES = 64  # cache-aware prefill choice: prompts compared in blocks of this many bytes
DISCOVER_TIMEOUT_S = 10.0


@dataclass
class Instance:
    url: str
    mode: str = "null"
    model: str = ""
    bootstrap_port: int | None = None
    in_flight: int = 0

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"


class PromptLength:
    """Tokens in a request's prompt as the router counts them: exact for token ids; for text, by the
    model's tokenizer (`tokenizer.json`); for a chat, its messages' text, without the tokens its chat
    template adds. A request of several prompts counts its longest."""

    def __init__(self, path: str) -> None:
        from pathlib import Path

        from tokenizers import Tokenizer

        file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        if not file.is_file():
            raise ConfigError(f"--tokenizer {path}: no tokenizer.json there")
        self.tokenizer = Tokenizer.from_file(str(file))

    def text(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def prompt(self, value) -> int:
        """A prompt field: text, token ids, or a list of either."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return len(value)
        if isinstance(value, list):
            return max((self.prompt(v) for v in value), default=0)
        return 0

    def __call__(self, body: dict) -> int:
        if isinstance(body.get("messages"), list):
            return sum(self.text(t) for t in _message_texts(body["messages"]))
        for field in ("prompt", "input_ids", "text"):
            if field in body:
                return self.prompt(body[field])
        return 0


def _message_texts(messages: list):
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))


class PDRouter:
    """With `replicas` instead (plain instances, --disaggregation-mode null), it routes each request
    to the least loaded one: the baseline that PD is measured against."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        replicas: list[str] = (),
        keys: tuple[str, ...] = (),
        local_prefill_max_tokens: int = 0,
        tokenizer: str | None = None,
    ) -> None:
        if replicas and (prefill or decode):
            raise ConfigError("afd router takes --replica instances, or --prefill and --decode ones, not both")
        if not replicas and (not prefill or not decode):
            raise ConfigError("afd router needs at least one --prefill and one --decode instance (or --replica ones)")
        self.replicas = bool(replicas)
        self.prefill = [Instance(u.rstrip("/")) for u in prefill]
        self.decode = [Instance(u.rstrip("/")) for u in (replicas or decode)]
        if local_prefill_max_tokens < 0:
            raise ConfigError(f"--local-prefill-max-tokens must be at least 0, not {local_prefill_max_tokens}")
        if local_prefill_max_tokens and tokenizer is None:
            raise ConfigError(
                "--local-prefill-max-tokens counts prompt tokens with the model's tokenizer: give --tokenizer "
                "(the checkpoint's directory, or its tokenizer.json)"
            )
        self.local_prefill_max_tokens = 0 if replicas else local_prefill_max_tokens
        self.prompt_length = PromptLength(tokenizer) if self.local_prefill_max_tokens else None
        self.affinity = CacheAwareBalancer(max(1, len(self.prefill)), PREFIX_BLOCK_BYTES)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        # the router's own calls to instances that share its key (a client's requests carry theirs)
        self.own_headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "afd_router_requests", "requests by endpoint and outcome", ["endpoint", "status"], registry=r
        )
        self.in_flight = Gauge("afd_router_in_flight", "requests in flight per instance", ["instance"], registry=r)
        self.local_prefills = Counter(
            "afd_router_local_prefills",
            "requests sent to a decode instance alone (prompt within --local-prefill-max-tokens)",
            registry=r,
        )

    async def discover(self) -> None:
        """Asks every instance its role and model; refuses a deployment whose parts do not fit."""
        for inst in self.prefill + self.decode:
            try:
                answer = await self.client.get(
                    inst.url + "/server_info", headers=self.own_headers, timeout=DISCOVER_TIMEOUT_S
                )
                if answer.status_code == 401:
                    raise ConfigError(
                        f"{inst.url} refuses the router's API key: give `afd router` the instances' key "
                        "(--api-key, --api-key-file or AFD_API_KEY)"
                    )
                info = answer.json()
            except (httpx.HTTPError, ValueError) as exc:
                raise ConfigError(f"{inst.url} does not answer GET /server_info: {exc}") from exc
            inst.mode, inst.model, inst.bootstrap_port = (
                info["disaggregation_mode"],
                info["model"],
                info["bootstrap_port"],
            )
        for inst in self.decode if self.replicas else ():
            if inst.mode != "null":
                raise ConfigError(f"--replica {inst.url} runs --disaggregation-mode {inst.mode}, not null")
        for inst in self.prefill:
            if inst.mode != "prefill":
                raise ConfigError(f"--prefill {inst.url} runs --disaggregation-mode {inst.mode}, not prefill")
        for inst in () if self.replicas else self.decode:
            if inst.mode != "decode":
                raise ConfigError(f"--decode {inst.url} runs --disaggregation-mode {inst.mode}, not decode")
        models = {i.model for i in self.prefill + self.decode}
        if len(models) > 1:
            raise ConfigError(f"the instances serve different models: {', '.join(sorted(models))}")

    def pick(self, room: int, body: dict) -> tuple[Instance | None, Instance]:
        """(prefill, decode) for a request; the prefill choice counts until `finished(room)`. No
        prefill instance for a replica, or for a prompt the decode instance prefills itself."""
        local = self.prompt_length is not None and self.prompt_length(body) <= self.local_prefill_max_tokens
        if local:
            self.local_prefills.inc()
        p = self.prefill[self.affinity.route(str(room), _prompt_key(body))] if self.prefill and not local else None
        d = min(self.decode, key=lambda i: i.in_flight)
        return p, d

    async def forward(self, path: str, request: Request) -> Response:
        endpoint = path.rsplit("/", 1)[-1]
        try:
            body = json.loads(await request.body())
        except ValueError:
            return openai_error(400, "The request body is not valid JSON.")
        if not isinstance(body, dict):
            return openai_error(400, "The request body must be a JSON object.")
        room = secrets.randbits(62) // ROOM_STRIDE * ROOM_STRIDE
        p, d = self.pick(room, body)
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        stream = body.get("stream") is True
        parts = (d,) if p is None else (p, d)
        for inst in parts:
            inst.in_flight += 1
            self.in_flight.labels(inst.url).set(inst.in_flight)
        if p is None:  # a replica (or a decode instance, for a short prompt) does the whole request
            prefill, d_body = asyncio.get_running_loop().create_future(), body
        else:
            p_body = {**body, "bootstrap_room": room, "stream": False}
            p_body.pop("stream_options", None)
            d_body = {**body, "bootstrap_room": room, "bootstrap_host": p.host, "bootstrap_port": p.bootstrap_port}
            prefill = asyncio.ensure_future(self.client.post(p.url + path, json=p_body, headers=headers))

        def release() -> None:
            self.affinity.finished(str(room))
            for inst in parts:
                inst.in_flight -= 1
                self.in_flight.labels(inst.url).set(inst.in_flight)
            if not prefill.done():
                prefill.cancel()  # closes the connection: the prefill instance aborts the request
            elif not prefill.cancelled():
                prefill.exception()  # seen (a failure the answer already reports): no "never retrieved" at exit

        # (a JSON answer's headers come when the decode instance has finished: the prefill side's
        # failure must be seen while waiting for them too)
        sending = asyncio.ensure_future(
            self.client.send(self.client.build_request("POST", d.url + path, json=d_body, headers=headers), stream=True)
        )
        try:
            failed = await _first_failure(sending, prefill)
            if failed is not None:
                sending.cancel()
                release()
                self.requests.labels(endpoint, "error").inc()
                return failed
            d_resp = sending.result()
        except httpx.HTTPError as exc:
            release()
            self.requests.labels(endpoint, "error").inc()
            return openai_error(503, f"the decode instance {d.url} is unavailable: {exc}", type="server_error")
        except asyncio.CancelledError:  # the client went away: closing both connections aborts both sides
            sending.cancel()
            release()
            raise
        if d_resp.status_code != 200 or not stream:
            return await self._whole(endpoint, d_resp, prefill, release)
        self.requests.labels(endpoint, "stream").inc()
        return StreamingResponse(
            self._relay(d_resp, prefill, release), status_code=200, media_type=d_resp.headers.get("content-type")
        )

    async def _whole(self, endpoint: str, d_resp: httpx.Response, prefill: asyncio.Future, release) -> Response:
        """A JSON answer (or an error): the decode instance's, unless the prefill instance failed first."""
        body = asyncio.ensure_future(d_resp.aread())
        try:
            failed = await _first_failure(body, prefill)
            if failed is not None:
                self.requests.labels(endpoint, "error").inc()
                return failed
            content = body.result()
        except httpx.HTTPError as exc:
            self.requests.labels(endpoint, "error").inc()
            return openai_error(503, f"the decode instance failed: {exc}", type="server_error")
        finally:
            body.cancel()
            await d_resp.aclose()
            release()
        self.requests.labels(endpoint, "ok" if d_resp.status_code == 200 else "error").inc()
        return Response(content, status_code=d_resp.status_code, media_type=d_resp.headers.get("content-type"))

    async def _relay(self, d_resp: httpx.Response, prefill: asyncio.Future, release):
        """The decode instance's event stream, cut with an error event if the prefill side fails."""
        chunks = d_resp.aiter_raw().__aiter__()
        try:
            while True:
                chunk = asyncio.ensure_future(chunks.__anext__())
                failed = await _first_failure(chunk, prefill)
                if failed is not None:
                    chunk.cancel()
                    yield f"data: {failed.body.decode()}\n\ndata: [DONE]\n\n".encode()
                    return
                try:
                    yield chunk.result()
                except StopAsyncIteration:
                    return
                except httpx.HTTPError as exc:
                    body = error_body(f"the decode instance failed: {exc}", type="server_error")
                    yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
                    return
        finally:
            await d_resp.aclose()
            release()

    async def health(self) -> Response:
        async def ok(inst: Instance) -> bool:
            try:
                return (await self.client.get(inst.url + "/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                return False

        states = await asyncio.gather(*(ok(i) for i in self.prefill + self.decode))
        healthy = all(states)
        return JSONResponse({"status": "ok" if healthy else "unavailable"}, status_code=200 if healthy else 503)


async def _first_failure(work: asyncio.Future, prefill: asyncio.Future) -> JSONResponse | None:
    """Waits for `work`; returns an OpenAI error if the prefill request fails before it ends."""
    while not work.done():
        waiting = {work} if prefill.done() else {work, prefill}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if prefill.done() and not work.done():
            failure = _prefill_failure(prefill)
            if failure is not None:
                return failure
    return None


def _prefill_failure(prefill: asyncio.Future) -> JSONResponse | None:
    if prefill.cancelled():
        return None
    exc = prefill.exception()
    if exc is not None:
        return openai_error(503, f"the prefill instance is unavailable: {exc!r}", type="server_error")
    resp: httpx.Response = prefill.result()
    if resp.status_code == 200:
        return None
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.text[:500]
    status = resp.status_code if resp.status_code < 500 else 503
    return openai_error(status, f"the prefill instance failed this request: {message}", type="server_error")


def _prompt_key(body: dict) -> bytes:
    """The prompt's text as bytes (chat messages, completion prompt, or /generate text or ids), for
    the cache-aware choice of a prefill instance."""
    for field in ("messages", "prompt", "text", "input_ids"):
        if field in body:
            value = body[field]
            return (value if isinstance(value, str) else json.dumps(value, sort_keys=True)).encode()
    return b""


def build_router_app(router: PDRouter, keys: tuple[str, ...] = (), metrics_require_key: bool = False) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        await router.discover()
        log.info(
            "routing over %d prefill and %d decode instances",
            len(router.prefill),
            len(router.decode),
        )
        yield
        await router.client.aclose()

    app = FastAPI(title="afd-router", lifespan=lifespan)

    for path in ROUTES:

        async def route(request: Request, path: str = path) -> Response:
            return await router.forward(path, request)

        app.add_api_route(path, route, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            resp = await router.client.get(router.decode[0].url + "/v1/models", headers=headers)
        except httpx.HTTPError as exc:
            return openai_error(503, f"the decode instance is unavailable: {exc}", type="server_error")
        return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    @app.get("/health")
    async def health():
        return await router.health()

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    install_auth(app, keys, metrics_require_key, invalid_api_key)  # the same rule as `afd serve`
    return app


def _watch_children(server, procs, state: dict) -> None:
    """Stops the router (exit 1) when an instance it started dies (`afd serve --pd`)."""
    while not server.should_exit:
        if any(p.poll() is not None for p in procs):
            log.error("an instance of the PD deployment died; exiting")
            state["died"] = True
            server.should_exit = True
            return
        time.sleep(0.2)


def run_router(
    prefill: list[str],
    decode: list[str],
    host: str,
    port: int,
    watch=None,
    replicas=(),
    keys: tuple[str, ...] = (),
    metrics_require_key: bool = False,
    local_prefill_max_tokens: int = 0,
    tokenizer: str | None = None,
    tls: dict | None = None,
) -> int:
    """Serves until interrupted (0); 2 when the instances do not answer or do not fit; with
    `watch` (instance processes this command started), 1 as soon as one of them dies. `keys`: the
    API keys clients must present (server/auth.py); the first is also what the router presents."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from afd_engine.proctitle import set_title

    set_title("afd::router")
    router = PDRouter(prefill, decode, replicas, keys, local_prefill_max_tokens, tokenizer)
    app = build_router_app(router, keys, metrics_require_key)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", **(tls or {})))
    state: dict = {}
    if watch:
        threading.Thread(target=_watch_children, args=(server, watch, state), daemon=True).start()
    try:
        server.run()
    except (
        SystemExit
    ) as exc:  # SIGTERM (see pd_launch), or startup failed (an instance did not answer, or the parts do not fit)
        if server.started and exc.code == 0:
            return 0
        return 2
    if state.get("died"):
        return 1
    return 0 if server.started else 2


def add_router_args(parser) -> None:
    parser.add_argument("--prefill", action="append", default=[], help="URL of a prefill instance (repeat)")
    parser.add_argument("--decode", action="append", default=[], help="URL of a decode instance (repeat)")
    parser.add_argument(
        "--replica", action="append", default=[], help="instead: URL of a plain instance (repeat); least loaded first"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=30000, help="HTTP port")
    parser.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=0,
        help="prompts of at most this many tokens go to a decode instance alone, which prefills them (0: none)",
    )
    parser.add_argument("--tokenizer", default=None, help="the model's tokenizer (its directory or tokenizer.json)")
    parser.add_argument(
        "--api-key", action="append", default=None, help="require this key (repeat for several; or AFD_API_KEY)"
    )
    parser.add_argument("--api-key-file", default=None, help="a file of API keys, one per line")
    parser.add_argument("--metrics-require-key", action="store_true", help="/metrics requires the key too")
    parser.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key (PEM)")
    parser.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate chain (PEM)")
    parser.add_argument("--ssl-ca-certs", default=None, help="require client certificates from these CAs (PEM)")


def main(argv: list[str]) -> int:
    """`afd router ...` (the CLI hands it over before importing the engine)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="afd router", description=__doc__.split("\n\n")[0])
    add_router_args(parser)
    ns = parser.parse_args(argv)
    try:
        keys = resolve_keys(ns.api_key, ns.api_key_file)
        tls = tls_settings(ns.ssl_keyfile, ns.ssl_certfile, ns.ssl_ca_certs)
        return run_router(
            ns.prefill,
            ns.decode,
            ns.host,
            ns.port,
            replicas=ns.replica,
            keys=keys,
            metrics_require_key=ns.metrics_require_key,
            local_prefill_max_tokens=ns.local_prefill_max_tokens,
            tokenizer=ns.tokenizer,
            tls=tls,
        )
    except ConfigError as exc:
        print(f"afd router: error: {exc}", file=sys.stderr)
        return 2
