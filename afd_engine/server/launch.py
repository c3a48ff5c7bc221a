"""`afd serve`: start the engine process, then the HTTP server in this process, and tie their lives.

    api server (this process: FastAPI + uvicorn)  --ZMQ ipc-->  engine process (scheduler + model)

The engine process is started first and must report ready (model loaded) before the server
binds its port; if it fails to start, the error is printed and the command exits with 2.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from afd_engine.default_model import DEFAULT_MODEL_NAME
from afd_engine.engine_args import EngineArgs
from afd_engine.errors import ConfigError
from afd_engine.server.engine_process import run_engine_process

log = logging.getLogger("afd.serve")
READY_TIMEOUT_S = 900


@dataclass(frozen=True)
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    default_max_tokens: int = 256


def serve(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine_args.validate()
    workdir = Path(tempfile.mkdtemp(prefix="afd-serve-"))
    requests_addr, outputs_addr = f"ipc://{workdir}/requests", f"ipc://{workdir}/outputs"
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_engine_process, args=(engine_args, requests_addr, outputs_addr, child_end),
                       name="afd-engine", daemon=True)
    proc.start()
    try:
        info = _wait_ready(parent_end, proc)
        if not info["ok"]:
            print(f"afd serve: error: the engine failed to start: {info['error']}", file=sys.stderr)
            return 2
        return _run_http(engine_args, server_args, info, requests_addr, outputs_addr, proc)
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_ready(conn, proc) -> dict:
    if not conn.poll(READY_TIMEOUT_S):
        raise ConfigError(f"the engine did not come up within {READY_TIMEOUT_S} s")
    try:
        return conn.recv()
    except EOFError:
        return {"ok": False, "error": f"the engine process exited with code {proc.exitcode}"}


def _run_http(engine_args, server_args: ServerArgs, info: dict, requests_addr, outputs_addr, proc) -> int:
    import uvicorn

    from afd_engine.server.api_server import build_app

    name = server_args.served_model_name or (DEFAULT_MODEL_NAME if not engine_args.model_path else
                                             Path(info["model_path"]).name)
    app = build_app(info["model_path"], name, server_args, info["context_len"], requests_addr, outputs_addr,
                    alive=proc.is_alive)
    if not engine_args.model_path:
        log.warning("serving the embedded tiny model %s: RANDOM WEIGHTS, its text is noise", name)
    base = f"http://{server_args.host}:{server_args.port}"
    auth = f' -H "Authorization: Bearer {server_args.api_key}"' if server_args.api_key else ""
    log.info("ready; try:\n  curl %s/v1/chat/completions -H 'Content-Type: application/json'%s "
             "-d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], "
             "\"max_tokens\": 16}'", base, auth, name)
    uvicorn.run(app, host=server_args.host, port=server_args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
