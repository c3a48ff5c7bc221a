"""A real `afd serve` subprocess on a free port, shared by the server tests."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from tests.process_helpers import afd_start, free_port, wait_healthy

__all__ = ["Server", "free_port"]


def serve_args(model_path: str, port: int) -> list[str]:
    """`afd serve` of the tests' servers: the tiny model on one thread, served as "tiny"."""
    return ["serve", "--model-path", model_path, "--port", str(port), "--num-threads", "1"] + [
        "--kv-cache-memory-mb",
        "16",
        "--served-model-name",
        "tiny",
    ]


class Server:
    def __init__(self, model_path: str, *extra: str, port: int | None = None, env: dict | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = afd_start(*serve_args(model_path, self.port), *extra, env=env)
        try:
            wait_healthy(self.url, 120, self.proc)
        except AssertionError:
            self.stop()
            raise

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server(tiny_v3):
    srv = Server(tiny_v3)
    yield srv
    srv.stop()
