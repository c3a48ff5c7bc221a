"""`afd serve`: the HTTP server in this process, the deployment's ranks as processes, lives tied.

    api server (this process: FastAPI + uvicorn)  --ZMQ ipc-->  attention ranks (or the one engine)

At startup the server binds its control sockets and starts every rank; the HTTP port opens only
when all are ready. If one fails to start, the error is logged and the command exits with 2; if
a rank dies later, requests in flight fail, /health turns 503 and the command exits with 1.
SIGTERM or SIGINT drains the server (server/drain.py), then stops it with 0; a second one stops it
at once with 128 + the signal's number.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from afd_engine.control.load_balance import LoadBalancer
from afd_engine.engine_args import EngineArgs, add_flags, check_fields, opt
from afd_engine.processes.deployment import Deployment

log = logging.getLogger("afd.serve")
# after a rank dies, requests in flight get this long to fail (each within about a second) before the
# server stops
DEATH_GRACE_S = 2.0
FORCED_EXIT = 128  # and above: exit statuses after a second SIGTERM or SIGINT (128 + its number)


@dataclass(frozen=True)
class ServerArgs:
    """The HTTP server's settings; each field is also a flag of `afd serve` / `afd launch`."""

    host: str = opt("127.0.0.1", "address to bind (default: loopback only)")
    port: int = opt(30000, "HTTP port")
    api_key: str | list[str] | None = opt(
        None,
        "require this bearer token on every route but /health (and /metrics); give it several times to "
        "accept several keys (rotation). AFD_API_KEY or --api-key-file keep it out of `ps`",
    )
    api_key_file: str | None = opt(None, "a file of API keys, one per line (# comments allowed)")
    metrics_require_key: bool = opt(False, "/metrics requires the API key too (open by default, for scrapers)")
    ssl_keyfile: str | None = opt(None, "serve HTTPS: the server's private key (PEM), with --ssl-certfile")
    ssl_certfile: str | None = opt(None, "serve HTTPS: the server's certificate chain (PEM), with --ssl-keyfile")
    ssl_ca_certs: str | None = opt(
        None, "with HTTPS, require a client certificate signed by one of these CAs (PEM): mutual TLS"
    )
    served_model_name: str | None = opt(None, "model name in the API (default: the checkpoint directory's name)")
    default_max_tokens: int = opt(256, "completion length when a request sets none")
    # Refused before parsing (413): a body is read whole into memory and parsed on the event loop.
    max_request_bytes: int = opt(16 * 1024 * 1024, "larger request bodies are refused with 413 before parsing")
    # About 4 characters a token covers a 128k-token context with room to spare, yet bounds the
    # tokenizer's work.
    max_prompt_chars: int = opt(1_000_000, "characters of text one request may send to the tokenizer (400 beyond)")
    drain_timeout: float = opt(
        5.0,
        "on SIGTERM or SIGINT, seconds the requests in flight get to finish while new ones get 503; "
        "a second signal stops the server at once",
    )
    tool_call_parser: str = opt(
        "auto",
        "the model's tool-call format: deepseekv3 (DeepSeek-V2/V3) or qwen25 (Qwen's <tool_call> blocks); "
        "auto picks by the checkpoint's architecture",
        choices=("auto", "deepseekv3", "qwen25"),
    )

    def __post_init__(self) -> None:
        self.validate()

    def tls(self) -> dict:
        """uvicorn's TLS settings (empty: plain HTTP)."""
        from afd_engine.server.auth import tls_settings

        return tls_settings(self.ssl_keyfile, self.ssl_certfile, self.ssl_ca_certs)

    def api_keys(self) -> tuple[str, ...]:
        """Every accepted key: --api-key, --api-key-file and AFD_API_KEY (server/auth.py)."""
        from afd_engine.server.auth import resolve_keys

        return resolve_keys(self.api_key, self.api_key_file)

    @staticmethod
    def add_cli_args(parser) -> None:
        add_flags(ServerArgs, parser)

    @classmethod
    def from_cli(cls, ns) -> ServerArgs:
        """The server flags of a parsed command line (see `add_cli_args`)."""
        import dataclasses

        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})

    def validate(self) -> None:
        from afd_engine.errors import ConfigError

        check_fields(self)
        self.api_keys()  # a missing or empty key file fails here, before any rank starts
        self.tls()  # (and a TLS file that is not there)
        for flag, value in (
            ("--max-request-bytes", self.max_request_bytes),
            ("--max-prompt-chars", self.max_prompt_chars),
        ):
            if value < 1:
                raise ConfigError(f"{flag}={value} must be at least 1; raise it instead of turning the limit off")
        if self.drain_timeout < 0:
            raise ConfigError(f"--drain-timeout={self.drain_timeout} must be at least 0 (seconds)")


def serve(engine_args: EngineArgs, server_args: ServerArgs, deployment: Deployment | None = None) -> int:
    """Runs until interrupted (exit 0 once drained; 128 + the signal's number after a second
    signal) or until a rank dies (exit 1)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from afd_engine.proctitle import set_title

    set_title("afd::api")
    engine_args.validate()
    deployment = deployment or Deployment(engine_args)
    # while the ranks start (and once the server has stopped), SIGTERM as an exception lets the
    # ranks stop (and tell their FFN ranks) instead of killing this process on the spot
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    status = None
    try:
        status = _run_http(deployment, server_args)
        return status
    finally:
        if status is not None and status >= FORCED_EXIT:  # a second signal: nothing waits
            deployment.stop(timeout=0.0)
        else:
            # a deployment that lost a rank cannot step again: its other ranks wait on the dead one,
            # so they get a moment to exit, not the graceful shutdown of a healthy deployment
            deployment.stop(timeout=10.0 if deployment.alive() else 1.0)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


def _run_http(deployment: Deployment, server_args: ServerArgs) -> int:
    import uvicorn

    from afd_engine.server.api_server import build_app
    from afd_engine.server.drain import DrainingServer

    args = deployment.args
    holder: dict = {}

    def start_ranks() -> dict:  # called once the server has bound the control sockets
        holder["info"] = deployment.start()
        return holder["info"]

    # the checkpoint directory's name; the embedded default's says what it is
    name = server_args.served_model_name or Path(args.model_path).name
    app = build_app(
        args.model_path,
        name,
        server_args,
        start_ranks,
        deployment.addrs,
        LoadBalancer.of(args.load_balance_method, deployment.num_attention_ranks, args.page_size),
        alive=deployment.alive,
        engine_args=args,
        lost_ranks=deployment.lost_attention_ranks if deployment.fault_tolerant else None,
        replace=deployment.replace_attention_rank if deployment.replaces_attention_ranks else None,
    )
    server = DrainingServer(
        uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level="warning", **server_args.tls()),
        app.state.drain,
    )
    watcher = threading.Thread(target=_watch, args=(deployment, server, holder), daemon=True)
    watcher.start()
    try:
        server.run()
    except SystemExit:  # uvicorn exits (status 3) when startup fails: here, a rank that did not start
        if holder.get("info"):
            raise
        return 2
    if holder.get("died"):
        log.error("a rank of the deployment died; exiting")
        return 1
    if server.exit_status:
        log.warning("stopped at once by a second signal, without finishing the drain")
        return server.exit_status
    return 0 if holder.get("info") else 2


def _watch(deployment: Deployment, server, holder: dict) -> None:
    """Stops the server (exit 1) a moment after any rank dies, once in-flight requests have failed."""
    while not server.should_exit:
        if holder.get("info") and not deployment.alive():
            holder["died"] = True
            time.sleep(DEATH_GRACE_S)
            server.should_exit = True
            return
        time.sleep(0.2)
