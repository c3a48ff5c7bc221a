"""Helpers for tests that run the `afd` command, HTTP servers and benchmarks as real subprocesses
(servers through benchmarks.lib.server, which the benchmarks start theirs with)."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from contextlib import contextmanager

from afd_engine.processes.rendezvous import free_port as free_port_on
from benchmarks.lib import server as servers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tests run two workers on two cores; one torch thread per process keeps them from fighting.
ENV = {**os.environ, "AFD_TEST_THREADS": "1"}


def free_port() -> int:
    return free_port_on("127.0.0.1")


def afd_run(*args: str, env=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`afd ARGS` to completion, output captured."""
    return subprocess.run(servers.afd_command(*args), capture_output=True, text=True, timeout=timeout, env=env or ENV)


def bench_module(script: str) -> str:
    """The module of benchmarks/SCRIPT ("bench_x.py", or a path under benchmarks/ like "dir/x.py")."""
    return "benchmarks." + script.removesuffix(".py").replace("/", ".")


def load_bench(script: str):
    """benchmarks/SCRIPT imported as its module (benchmarks.NAME), for tests of its pure functions."""
    return importlib.import_module(bench_module(script))


def bench_run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m benchmarks.NAME ARGS` (SCRIPT: benchmarks/NAME.py) from the repository root to
    completion; fails the test with the end of its output when it exits non-zero."""
    res = subprocess.run(
        [sys.executable, "-m", bench_module(script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def afd_start(*args: str, new_session: bool = False, env: dict | None = None) -> subprocess.Popen:
    """`afd ARGS` in the background, stdout and stderr merged into one text pipe (`env`: more
    environment variables)."""
    return servers.spawn(
        servers.afd_command(*args),
        stdout=subprocess.PIPE,
        text=True,
        env={**ENV, **(env or {})},
        new_session=new_session,
    )


@contextmanager
def stopped_after(procs: list[subprocess.Popen]):
    """Kills what is still running of `procs` (started with afd_start) at the end; when the block
    fails, prints the end of each one's output first (pytest shows it with the failure)."""
    try:
        yield
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.kill()
            out = p.communicate(timeout=30)[0] or ""
            print(f"--- output of afd {' '.join(p.args[3:6])} (exit {p.returncode}):\n{out[-6000:]}")
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def wait_healthy(url: str, timeout: float = 120, proc: subprocess.Popen | None = None) -> None:
    """Until GET url/health answers 200: RuntimeError (with its output) if `proc` exits first,
    AssertionError when `timeout` passes."""
    try:
        servers.wait_healthy(url, proc, timeout)
    except servers.ServerNotReady as exc:
        if exc.returncode is None:
            raise AssertionError(str(exc)) from None
        raise


def proc_title(pid: int) -> str:
    """The name a process gave itself (afd_engine/proctitle.py), as `ps` shows it; "" when gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


@contextmanager
def launched_roles(log_dir, common: list[str]):
    """`afd launch` roles sharing the arguments `common`, each in its own process group with its
    output in log_dir/roleN.log: yields `role(*args) -> Popen`. At the end every group still running
    is killed; when the block fails, each role's log ends are printed first."""
    logs, procs = [], []

    def role(*args: str) -> subprocess.Popen:
        logs.append(open(os.path.join(log_dir, f"role{len(logs)}.log"), "w"))
        cmd = [sys.executable, "-m", "afd_engine.cli", "launch", *args, *common]
        procs.append(subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT, env=ENV, start_new_session=True))
        return procs[-1]

    try:
        yield role
    except BaseException:
        for f in logs:
            f.flush()
            with open(f.name) as out:
                print(f"--- {f.name}:\n{out.read()[-6000:]}")
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for f in logs:
            f.close()
