"""When the engine process dies, the API says so quickly instead of hanging."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from tests.process_helpers import proc_title
from tests.server.conftest import Server


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (rank processes are children of the forkserver the launcher starts)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    out, frontier = [], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        out += frontier
    return out


def test_dead_engine_makes_health_and_requests_fail_fast(tiny_v3):
    srv = Server(tiny_v3)
    try:
        engines = [p for p in children(srv.proc.pid) if proc_title(p) == "afd::engine"]
        assert len(engines) == 1, "no engine child process found"
        assert proc_title(srv.proc.pid) == "afd::api"
        for pid in engines:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while httpx.get(srv.url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(srv.url + "/health").status_code == 503
        start = time.monotonic()
        resp = httpx.post(
            srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3}, timeout=30
        )
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "server_error"
        assert time.monotonic() - start < 10
    finally:
        srv.stop()
