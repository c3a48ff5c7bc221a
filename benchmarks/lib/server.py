"""Servers for benchmarks and tests: a process started on a free local port, ready once its health
route answers 200, stopped with SIGTERM and, after a grace period, SIGKILL.

    with afd_server("serve", "--mode", "single") as srv:   # afd serve --mode single --port <free>
        httpx.get(srv.url + "/v1/models")

A server that exits before it is ready, or is not ready in time, raises ServerNotReady with the end
of its output in the message.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import httpx

from afd_engine.processes.rendezvous import free_port

HOST = "127.0.0.1"
TAIL_CHARS = 6000  # of a server's output, in the error when it does not become ready
POLL_S = 0.2
KILL_WAIT_S = 5.0  # for the processes of a group to be gone after SIGKILL


class ServerNotReady(RuntimeError):
    """A server exited before its health route answered 200 (`returncode` is its exit status), or
    did not answer it in time (`returncode` is None)."""

    def __init__(self, message: str, returncode: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode


def afd_command(*args: str) -> list[str]:
    """`afd ARGS` run by this interpreter, so that the server sees the caller's environment."""
    return [sys.executable, "-m", "afd_engine.cli", *args]


def spawn(
    cmd: Sequence[str],
    *,
    stdout=None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    cores: Iterable[int] | None = None,
    new_session: bool = False,
    text: bool = False,
) -> subprocess.Popen:
    """`cmd` in the background. `stdout`: a file, subprocess.PIPE or DEVNULL (stderr joins it), or
    None to inherit both; `env`: variables added to this process's environment; `cores`: the CPUs
    it (and every process it starts) may run on; `new_session`: a process group of its own, which
    stop_process(group=True) signals as a whole."""
    preexec = None
    if cores is not None:
        mask = set(cores)

        def preexec() -> None:
            os.sched_setaffinity(0, mask)

    return subprocess.Popen(
        list(cmd),
        stdout=stdout,
        stderr=None if stdout is None else subprocess.STDOUT,
        env={**os.environ, **env} if env else None,
        cwd=cwd,
        start_new_session=new_session,
        preexec_fn=preexec,
        text=text,
    )


def wait_healthy(
    url: str,
    proc: subprocess.Popen | None = None,
    timeout: float = 300.0,
    *,
    health: str = "/health",
    output: Callable[[], str] | None = None,
    name: str | None = None,
) -> None:
    """Polls GET url + health until it answers 200 (at least once, whatever `timeout`).
    ServerNotReady when `proc` exits first or `timeout` seconds pass, with the end of the server's
    output: `output()`, or what `proc`'s output pipe holds."""
    name = name or url
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            why = f"{name} exited with status {proc.returncode} before it was healthy"
            raise ServerNotReady(why + _tail(proc, output), proc.returncode)
        # trust_env=False: a proxy from the environment must not stand between us and a local server
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + health, timeout=2, trust_env=False).status_code == 200:
                return
        if time.monotonic() >= deadline:
            raise ServerNotReady(f"{name} was not healthy within {timeout:g} s{_tail(proc, output)}")
        time.sleep(POLL_S)


def _tail(proc: subprocess.Popen | None, output: Callable[[], str] | None) -> str:
    text = output() if output is not None else _pipe_text(proc) if proc is not None else ""
    return f"\n--- the end of its output:\n{text[-TAIL_CHARS:]}" if text.strip() else ""


def _pipe_text(proc: subprocess.Popen) -> str:
    """What `proc`'s stdout pipe holds now, read without blocking: the workers it started may still
    hold the pipe open after it exited."""
    pipe = proc.stdout
    if pipe is None or pipe.closed:
        return ""
    fd = pipe.fileno()
    blocking = os.get_blocking(fd)
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    finally:
        os.set_blocking(fd, blocking)
    return b"".join(chunks).decode(errors="replace")


def stop_process(
    proc: subprocess.Popen, grace: float = 30.0, *, group: bool = False, sig: int = signal.SIGTERM
) -> None:
    """`sig` to the process, SIGKILL if it has not exited `grace` seconds later. With `group` (the
    process was started with new_session) what of its process group outlives it gets the rest of
    the grace period to shut down, then SIGKILL. Returns once the process (and its group) has
    exited; a process already gone is fine."""
    deadline = time.monotonic() + grace
    if proc.poll() is None:
        proc.send_signal(sig)  # the server itself: it stops the processes it started in order
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    if group:
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # gone, or the id is no longer ours
            os.killpg(proc.pid, signal.SIGKILL)
    elif proc.poll() is None:
        proc.kill()
    proc.wait()
    killed = time.monotonic() + KILL_WAIT_S
    while group and _group_alive(proc.pid) and time.monotonic() < killed:  # SIGKILL takes a moment
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. Zombies do not count: where nothing reaps
    orphans (a container's first process may not), they would stay forever."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in proc_dir.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
        except (OSError, IndexError):
            continue
        if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


class Server:
    """A server process on a free local port (or `port`), healthy once constructed.

    `command` is its argv: a function of the port, or a list that already holds `port`. Its output
    goes to `log_path` (kept) or to a temporary file removed when it stops; ServerNotReady carries
    the file's end. In a session of its own (`new_session`, the default) stopping it signals every
    process it started too. `env`, `cwd` and `cores` are spawn's. Stop it with stop(), or use it as
    a context manager.
    """

    def __init__(
        self,
        command: Callable[[int], Sequence[str]] | Sequence[str],
        *,
        port: int | None = None,
        timeout: float = 300.0,
        health: str = "/health",
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        cores: Iterable[int] | None = None,
        new_session: bool = True,
        grace: float = 30.0,
        stop_signal: int = signal.SIGTERM,
    ) -> None:
        if port is None and not callable(command):
            raise ValueError("a command given as a list needs port=, the port it holds")
        self.port = free_port(HOST) if port is None else port
        self.url = f"http://{HOST}:{self.port}"
        self.cmd = list(command(self.port) if callable(command) else command)
        self._group, self._grace, self._stop_signal = new_session, grace, stop_signal
        self._temporary = log_path is None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="server-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:  # the server keeps its own copy of the descriptor
            self.proc = spawn(self.cmd, stdout=log, env=env, cwd=cwd, cores=cores, new_session=new_session)
        try:
            wait_healthy(self.url, self.proc, timeout, health=health, output=self.log_tail, name=self.name)
        except BaseException:
            self.stop()
            raise

    @property
    def name(self) -> str:
        """The command, short: `afd serve` or the program's name, and where it listens."""
        if self.cmd[1:3] == ["-m", "afd_engine.cli"]:
            return f"afd {self.cmd[3]} on port {self.port}" if len(self.cmd) > 3 else "afd"
        return f"{Path(self.cmd[0]).name} on port {self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = TAIL_CHARS) -> str:
        """The end of the server's output so far ("" once a temporary log is gone)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4 * chars))
                data = f.read()
        except OSError:
            return ""
        return data.decode(errors="replace")[-chars:]

    def stop(self) -> None:
        """Stops the server (stop_process); calling it again does nothing more."""
        stop_process(self.proc, self._grace, group=self._group, sig=self._stop_signal)
        if self._temporary:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def afd_server(*args: str, **options) -> Server:
    """`afd ARGS --port P` on a free port P, as a Server (`options`: Server's keywords)."""
    return Server(lambda port: afd_command(*args, "--port", str(port)), **options)
