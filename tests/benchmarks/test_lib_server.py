"""benchmarks.lib.server: a server on a free port is healthy once started and gone once stopped; one
that exits early or never answers fails with the end of its output, and is not left running."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks.lib.server import Server, ServerNotReady, spawn, stop_process


def http_server(port: int) -> list[str]:
    """Python's file server: GET / answers 200 (a listing of its directory)."""
    return [sys.executable, "-u", "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def test_a_server_is_healthy_once_started_and_stopped_at_the_end_of_the_block(tmp_path):
    with Server(http_server, health="/", cwd=tmp_path, timeout=60) as srv:
        assert srv.url == f"http://127.0.0.1:{srv.port}" and srv.alive()
        assert httpx.get(srv.url + "/", trust_env=False).status_code == 200
        assert "Serving HTTP" in srv.log_tail()
    assert not srv.alive() and not srv.log_path.exists()  # the temporary log goes with it
    srv.stop()  # again: nothing left to do


def test_a_server_that_exits_early_fails_with_its_output():
    def crash(port: int) -> list[str]:
        return [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]

    with pytest.raises(ServerNotReady, match="no model here") as info:
        Server(crash, timeout=60)
    assert info.value.returncode == 3 and "exited with status 3" in str(info.value)


def test_a_server_that_never_answers_fails_after_the_timeout_and_is_stopped(tmp_path):
    log = tmp_path / "silent.log"

    def silent(port: int) -> list[str]:
        return [sys.executable, "-u", "-c", "import time; print('still loading'); time.sleep(60)"]

    with pytest.raises(ServerNotReady, match="not healthy within 1 s") as info:
        Server(silent, timeout=1, log_path=log, grace=5)
    assert info.value.returncode is None and "still loading" in str(info.value)
    assert log.exists()  # a log asked for is kept


def test_a_command_list_needs_its_port():
    with pytest.raises(ValueError, match="port"):
        Server(http_server(8000))


def test_stopping_a_group_reaches_the_workers_that_outlive_the_server():
    # the leader exits on SIGTERM; its worker ignores SIGTERM and would run on
    code = (
        "import signal, subprocess, sys, time; "
        "w = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)'],"
        " stdout=subprocess.PIPE); w.stdout.readline(); print(w.pid, flush=True); time.sleep(60)"
    )
    proc = spawn([sys.executable, "-c", code], stdout=subprocess.PIPE, new_session=True, text=True)
    worker = int(proc.stdout.readline())
    stop_process(proc, grace=1, group=True)
    assert proc.returncode is not None
    try:  # gone, or a zombie that nobody here may reap
        state = Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("Z", "gone")
