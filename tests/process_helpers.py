"""Helpers for tests that run the `afd` command and HTTP servers as real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx

from afd_engine.distributed.rendezvous import free_port as free_port_on

# Tests run two workers on two cores; one torch thread per process keeps them from fighting.
ENV = {**os.environ, "AFD_TEST_THREADS": "1"}


def free_port() -> int:
    return free_port_on("127.0.0.1")


def afd_run(*args: str, env=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`afd ARGS` to completion, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "afd_engine.cli", *args], capture_output=True, text=True, timeout=timeout, env=env or ENV
    )


def load_bench(script: str):
    """benchmarks/SCRIPT imported as a module of its own name (registered in sys.modules: dataclasses
    look their module up there), for tests of its pure functions."""
    import importlib.util

    name = script.removesuffix(".py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def bench_run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python benchmarks/SCRIPT ARGS` from the repository root to completion; fails the test with
    the end of its output when it exits non-zero."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run(
        [sys.executable, os.path.join("benchmarks", script), *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def afd_start(*args: str, new_session: bool = False, env: dict | None = None) -> subprocess.Popen:
    """`afd ARGS` in the background, stdout and stderr merged into one text pipe (`env`: more
    environment variables)."""
    return subprocess.Popen(
        [sys.executable, "-m", "afd_engine.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**ENV, **(env or {})},
        start_new_session=new_session,
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
    """Until GET url/health answers 200; fails early (with its output) if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not healthy within {timeout} s")


def proc_title(pid: int) -> str:
    """The name a process gave itself (afd_engine/proctitle.py), as `ps` shows it; "" when gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""
