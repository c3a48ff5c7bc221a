"""`afd router`: the OpenAI-compatible front of a prefill-decode disaggregated deployment.

    client --> router --(request + bootstrap_room)-----------------------> prefill instance
                      --(request + room + the prefill's bootstrap address)-> decode instance
                      <------------------- tokens (stream or JSON) ------- decode instance

Per request the router picks a prefill instance (cache-aware: the one it last sent the longest
prefix of this prompt's text, unless much busier) and a decode instance (the fewest requests in
flight), sends both the same request under one random room id, and relays the decode instance's
answer. The prefill instance's answer only says whether it did its part: a prefill instance
that fails the request fails it (an OpenAI error, or an error event in a stream) and the decode
request is closed, which frees its pages; a client that goes away closes both. An instance that
is lost (dead, hung, draining) is left out, and its requests move to others (pd_failover.py).

Conditional disaggregation (--local-prefill-max-tokens N, with --tokenizer): a request whose
prompt has at most N tokens goes to the decode instance alone, which prefills it itself. A short
prompt's prefill costs a decode batch little, and it skips the queue behind long prompts on the
prefill instance and the KV transfer; long prompts still prefill on the prefill instance.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
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
from afd_engine.server import pd_failover as failover
from afd_engine.server.auth import install_auth, resolve_keys, tls_settings
from afd_engine.server.drain import Drain, DrainGate, DrainingServer
from afd_engine.server.errors import install_exception_handlers, invalid_api_key, openai_error

log = logging.getLogger("afd.router")
ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
PREFIX_BLOCK_BYTES = 64  # cache-aware prefill choice: prompts compared in blocks of this many bytes
DISCOVER_TIMEOUT_S = 10.0


@dataclass(eq=False)  # (each one is itself: kept in sets)
class Instance:
    url: str
    mode: str = "null"
    model: str = ""
    bootstrap_port: int | None = None
    in_flight: int = 0
    state: str = failover.UP  # UP, DRAINING or LOST (pd_failover.py)
    failed_checks: int = 0  # periodic health checks failed in a row
    attempts: set = dataclasses.field(default_factory=set)  # the tries of requests that depend on it

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
        # failover (pd_failover.py): with prefill instances only (a replica's request has no room
        # to resume under)
        self.failover = bool(self.prefill)
        self.failovers = Counter(
            "afd_router_failovers",
            "requests moved off a lost instance: sent again (nothing had reached the client) or resumed mid-stream",
            ["kind"],
            registry=r,
        )
        self.instance_up = Gauge(
            "afd_router_instance_up", "1 while an instance is up (0: lost or draining)", ["instance"], registry=r
        )
        self._monitor: asyncio.Task | None = None

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
        for inst in self.prefill + self.decode:
            self.instance_up.labels(inst.url).set(1)
        if self.failover and self._monitor is None:
            logging.getLogger("httpx").setLevel(logging.WARNING)  # (not a line per health check)
            self._monitor = asyncio.ensure_future(self._check_health())

    async def _check_health(self) -> None:
        """Every HEALTH_INTERVAL_S until the client closes: an instance is lost after LOST_AFTER
        failed checks in a row, draining while it says so, and up again once it answers."""
        while not self.client.is_closed:
            await asyncio.sleep(failover.HEALTH_INTERVAL_S)
            insts = self.prefill + self.decode
            try:
                states = await asyncio.gather(*(failover.probe(self.client, i.url) for i in insts))
                for inst, state in zip(insts, states):
                    inst.failed_checks = inst.failed_checks + 1 if state == failover.LOST else 0
                    if state == failover.UP and inst.state == failover.LOST and not await self._rejoins(inst):
                        continue
                    if state != failover.LOST or inst.failed_checks >= failover.LOST_AFTER:
                        self.mark(inst, state)
            except RuntimeError:  # the client closed meanwhile
                return
            except Exception:  # the checks go on whatever one round met
                log.exception("health check round failed")

    async def _rejoins(self, inst: Instance) -> bool:
        """A lost instance answers again (restarted): still its role and model? Its bootstrap port
        may be new."""
        try:
            info = (await self.client.get(inst.url + "/server_info", headers=self.own_headers)).json()
        except (httpx.HTTPError, ValueError):
            return False
        if (info.get("disaggregation_mode"), info.get("model")) != (inst.mode, inst.model):
            return False
        inst.bootstrap_port = info.get("bootstrap_port")
        return True

    def mark(self, inst: Instance, state: str) -> None:
        """Records an instance's state: only an instance up takes new requests, and the requests
        on one that is lost move (one that drains finishes its own)."""
        if state != inst.state:
            log.warning("%s instance %s is %s", inst.mode, inst.url, state)
            inst.state = state
            self.instance_up.labels(inst.url).set(1 if state == failover.UP else 0)
        if state == failover.LOST:
            for attempt in list(inst.attempts):
                attempt.notice(inst)

    async def lost(self, attempt, decode: bool) -> bool:
        """After a try failed: asks its instances' /health at once (the decode one if `decode`, the
        prefill one while the try depends on it); True if one of them is not up."""
        insts = [attempt.d] if decode else []
        if attempt.p is not None and (attempt.watches_prefill or not decode):
            insts.append(attempt.p)
        states = await asyncio.gather(*(failover.probe(self.client, i.url) for i in insts))
        for inst, state in zip(insts, states):
            self.mark(inst, state)
        return any(state != failover.UP for state in states)

    def hold(self, attempt) -> None:
        for inst in attempt.parts:
            inst.in_flight += 1
            inst.attempts.add(attempt)
            self.in_flight.labels(inst.url).set(inst.in_flight)

    def release(self, attempt) -> None:
        self.affinity.finished(str(attempt.room))
        for inst in attempt.parts:
            inst.in_flight -= 1
            inst.attempts.discard(attempt)
            self.in_flight.labels(inst.url).set(inst.in_flight)

    def pick(
        self, room: int, body: dict, exclude=(), local: bool = True, prefer: Instance | None = None
    ) -> tuple[Instance | None, Instance] | str:
        """(prefill, decode) for a request, of the instances not in `exclude` that are up (or, when
        none of a role is, any: one may be back before a health check saw it); the decode one
        `prefer` where it is up. The prefill choice counts until `release`. No prefill instance for
        a replica, or (`local`) for a prompt the decode instance prefills itself. Why not, when a
        role has no instance left."""
        decode = _usable(self.decode, exclude)
        if not decode:
            return "no decode instance is left for this request: each was lost"
        d = prefer if prefer in decode else min(decode, key=lambda i: i.in_flight)
        local = local and self.prompt_length is not None and self.prompt_length(body) <= self.local_prefill_max_tokens
        if local:
            self.local_prefills.inc()
        if not self.prefill or local:
            return None, d
        usable = _usable(self.prefill, exclude)
        if not usable:
            return "no prefill instance is left for this request: each was lost"
        rank = self.affinity.route(str(room), _prompt_key(body))
        if self.prefill[rank] not in usable:
            best = min(usable, key=lambda i: self.affinity.load[self.prefill.index(i)])
            rank = self.affinity.route_to(str(room), self.prefill.index(best))
        return self.prefill[rank], d

    async def forward(self, path: str, request: Request) -> Response:
        endpoint = path.rsplit("/", 1)[-1]
        try:
            body = json.loads(await request.body())
        except ValueError:
            return openai_error(400, "The request body is not valid JSON.")
        if not isinstance(body, dict):
            return openai_error(400, "The request body must be a JSON object.")
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        stream = body.get("stream") is True
        job = failover.Job(path, endpoint, body, headers, stream, failover.num_choices(path, body))
        opened = await failover.open_request(self, job)
        if isinstance(opened, Response):
            self.requests.labels(endpoint, "error").inc()
            return opened
        resp = opened.response
        if not stream:
            await opened.close()
            self.requests.labels(endpoint, "ok").inc()
            return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))
        self.requests.labels(endpoint, "stream").inc()
        return StreamingResponse(
            failover.relay(self, job, opened), status_code=200, media_type=resp.headers.get("content-type")
        )

    async def health(self) -> Response:
        """ok while requests can be served: at least one decode instance, and one prefill instance
        where there are any, answer ok (afd_router_instance_up in /metrics tells which)."""
        insts = self.prefill + self.decode
        states = await asyncio.gather(*(failover.probe(self.client, i.url) for i in insts))
        up = {id(i) for i, state in zip(insts, states) if state == failover.UP}
        healthy = any(id(i) in up for i in self.decode) and (not self.prefill or any(id(i) in up for i in self.prefill))
        return JSONResponse({"status": "ok" if healthy else "unavailable"}, status_code=200 if healthy else 503)


def _usable(insts: list[Instance], exclude) -> list[Instance]:
    candidates = [i for i in insts if i not in exclude]
    return [i for i in candidates if i.state == failover.UP] or candidates


def _prompt_key(body: dict) -> bytes:
    """The prompt's text as bytes (chat messages, completion prompt, or /generate text or ids), for
    the cache-aware choice of a prefill instance."""
    for field in ("messages", "prompt", "text", "input_ids"):
        if field in body:
            value = body[field]
            return (value if isinstance(value, str) else json.dumps(value, sort_keys=True)).encode()
    return b""


def build_router_app(
    router: PDRouter, keys: tuple[str, ...] = (), metrics_require_key: bool = False, drain: Drain | None = None
) -> FastAPI:
    from contextlib import asynccontextmanager

    drain = drain or Drain(5.0, log)  # draining on SIGTERM (server/drain.py), as `afd serve`

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
    install_exception_handlers(app)  # a client gets OpenAI's JSON error shape, a router bug included

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
        if drain.draining:
            return drain.health()
        return await router.health()

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    install_auth(app, keys, metrics_require_key, invalid_api_key)  # the same rule as `afd serve`
    app.add_middleware(DrainGate, drain=drain)
    draining = Gauge(
        "afd_router_draining", "1 while the router drains after SIGTERM or SIGINT", registry=router.registry
    )
    draining.set_function(lambda: float(drain.draining))
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
    drain_timeout: float = 5.0,
) -> int:
    """Serves until interrupted (0 once drained; 128 + the signal's number after a second signal);
    2 when the instances do not answer or do not fit; with `watch` (instance processes this
    command started), 1 as soon as one of them dies. `keys`: the
    API keys clients must present (server/auth.py); the first is also what the router presents."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from afd_engine.proctitle import set_title

    set_title("afd::router")
    router = PDRouter(prefill, decode, replicas, keys, local_prefill_max_tokens, tokenizer)
    drain = Drain(drain_timeout, log)
    app = build_router_app(router, keys, metrics_require_key, drain)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="warning", **(tls or {})), drain)
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
    if server.exit_status:  # a second signal stopped the drain
        return server.exit_status
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
        "--drain-timeout",
        type=float,
        default=5.0,
        help="on SIGTERM or SIGINT, seconds the streams in flight get to finish while new requests get 503",
    )
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
    import sys

    from afd_engine.arg_errors import ArgumentParser

    parser = ArgumentParser(prog="afd router", description=__doc__.split("\n\n")[0])
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
            drain_timeout=ns.drain_timeout,
        )
    except ConfigError as exc:
        print(f"afd router: error: {exc}", file=sys.stderr)
        return 2
