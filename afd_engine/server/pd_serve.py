"""`afd serve --pd`: a whole prefill-decode deployment on this machine with one command.

    afd serve --pd --prefill-mode single --decode-mode afd --port 30000 [flags...]

starts a prefill instance and a decode instance (each an `afd serve` process with its ranks, on
free ports) and `afd router` in this process on --port. Every other flag goes to both instances;
--prefill-args / --decode-args add flags to one of them only (later flags win). The command exits
with 1 when an instance dies, and stops both when it is stopped. Across machines, start the
instances with `afd serve --disaggregation-mode ...` and `afd router` yourself (launch/pd/).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import time

import httpx

from afd_engine.errors import ConfigError
from afd_engine.processes.rendezvous import free_port

log = logging.getLogger("afd.serve")
OWN_FLAGS = {"--pd": 0, "--prefill-mode": 1, "--decode-mode": 1, "--prefill-args": 1, "--decode-args": 1, "--port": 1}
OWN_FLAGS |= {"--local-prefill-max-tokens": 1}  # the router's
# the API keys and the cluster secret reach the instances in their environment (instance_env), not command lines
OWN_FLAGS |= {"--api-key": 1, "--api-key-file": 1, "--cluster-secret": 1}
# the router serves HTTPS; the instances answer it over loopback
OWN_FLAGS |= {"--ssl-keyfile": 1, "--ssl-certfile": 1, "--ssl-ca-certs": 1}
READY_TIMEOUT_S = 900


def instance_argv(argv: list[str], mode: str, role: str, port: int, extra: str, bootstrap: int | None) -> list[str]:
    """The `afd serve` command line of one instance: the shared flags, its role, its own flags."""
    shared, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in ("--mode", "--disaggregation-mode"):
            raise ConfigError(f"afd serve --pd sets {flag} itself: use --prefill-mode / --decode-mode")
        if flag in OWN_FLAGS:
            i += 1 + (OWN_FLAGS[flag] if "=" not in argv[i] else 0)
            continue
        shared.append(argv[i])
        i += 1
    out = [*shared, "--mode", mode, "--disaggregation-mode", role, "--port", str(port)]
    if bootstrap is not None:
        out += ["--disaggregation-bootstrap-port", str(bootstrap)]
    return out + shlex.split(extra)


def instance_env(keys: tuple[str, ...], cluster_secret: str | None = None) -> dict:
    """The instances' environment: this one's, with every API key in AFD_API_KEY (one per line)
    and the cluster secret in AFD_CLUSTER_SECRET, so that neither shows in `ps` (server/auth.py)."""
    from afd_engine.server.auth import ENV_KEY
    from comm.auth import ENV

    env = dict(os.environ)
    env.pop(ENV_KEY, None)
    if keys:
        env[ENV_KEY] = "\n".join(keys)
    if cluster_secret:
        env[ENV] = cluster_secret
    return env


def serve_pd(argv: list[str], ns) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from afd_engine.server.auth import tls_settings

    tls = tls_settings(ns.ssl_keyfile, ns.ssl_certfile, ns.ssl_ca_certs)
    # until the router serves (which drains on SIGTERM, then returns), SIGTERM as an exception lets
    # the instances stop
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    host = "127.0.0.1"
    p_port, d_port = free_port(host), free_port(host)
    bootstrap = None if any(a.startswith("--disaggregation-bootstrap-port") for a in argv) else free_port(host)
    commands = {
        "prefill": instance_argv(argv, ns.prefill_mode, "prefill", p_port, ns.prefill_args, bootstrap),
        "decode": instance_argv(argv, ns.decode_mode, "decode", d_port, ns.decode_args, None),
    }
    from afd_engine.server.auth import resolve_keys

    keys = resolve_keys(ns.api_key, ns.api_key_file)
    env = instance_env(keys, ns.cluster_secret)
    procs = {
        role: subprocess.Popen([sys.executable, "-m", "afd_engine.cli", "serve", *cmd], env=env)
        for role, cmd in commands.items()
    }
    try:
        for role, port in (("prefill", p_port), ("decode", d_port)):
            if not wait_healthy(f"http://{host}:{port}", procs[role]):
                log.error("the %s instance did not start", role)
                return 2
        from afd_engine.default_model import resolve_model_path
        from afd_engine.server.pd_router import run_router

        return run_router(
            [f"http://{host}:{p_port}"],
            [f"http://{host}:{d_port}"],
            ns.host,
            ns.port,
            watch=list(procs.values()),
            keys=keys,  # the instances' own
            metrics_require_key=ns.metrics_require_key,
            local_prefill_max_tokens=ns.local_prefill_max_tokens,
            tokenizer=str(resolve_model_path(ns.model_path)),
            tls=tls,
            drain_timeout=ns.drain_timeout,
        )
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = READY_TIMEOUT_S) -> bool:
    """Until GET url/health answers 200 (True); False when `proc` exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False
