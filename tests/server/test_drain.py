"""`afd serve` drains on SIGTERM and SIGINT: streams in flight finish whole while new requests get
503 and /health says "draining", then the process exits 0; a second signal stops it at once with
128 + the signal's number; at --drain-timeout what still runs is cut with an error."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from afd_engine.tiny_model import make_tiny_model
from tests.process_helpers import afd_start, free_port, proc_title, stopped_after, wait_healthy
from tests.server.conftest import Server
from tests.server.test_engine_death import children

DRAINING = "the server is draining: it is shutting down and takes no new requests; retry (another replica will answer)"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
LONG_TOKENS = 30_000  # minutes of decoding for the tiny model: still running whenever the test looks


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    """The tiny model with a context long enough for a request that outlasts every test."""
    out = tmp_path_factory.mktemp("long-context")
    return str(make_tiny_model(out, arch="deepseek_v2", overrides={"max_position_embeddings": 32768}))


def engine_pids(srv: Server) -> list[int]:
    pids = [p for p in children(srv.proc.pid) if proc_title(p) == "afd::engine"]
    assert len(pids) == 1, "no engine child process found"
    return pids


def wait_draining(srv: Server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(srv.url + "/health", timeout=5)
        if health.status_code == 503:
            assert health.json() == {"status": "draining"}
            return
        assert health.status_code == 200 and time.monotonic() < deadline, "the server did not start draining"
        time.sleep(0.05)


def wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(proc_title(p) for p in pids):
        assert time.monotonic() < deadline, "a rank process outlived the server"
        time.sleep(0.1)


def open_streams(client: openai.OpenAI, prompts: list[str], max_tokens: int) -> list:
    """One streaming completion per prompt; each call returns once the response's headers came."""
    return [
        client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        for p in prompts
    ]


def read_stream(stream) -> tuple[str, int]:
    text, tokens = "", None
    for chunk in stream:
        text += "".join(c.text for c in chunk.choices)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, tokens


def test_sigterm_lets_the_streams_in_flight_finish_and_refuses_new_requests(tiny_v3):
    srv = Server(tiny_v3, "--drain-timeout", "60")
    with stopped_after([srv.proc]):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        prompts = [f"request {i} of eight, which the drain lets finish" for i in range(8)]
        undisturbed = [read_stream(s) for s in open_streams(client, prompts, 64)]
        assert all(tokens == 64 for _, tokens in undisturbed)
        assert srv.metric("afd_draining") == 0
        engines = engine_pids(srv)
        # the engine holds still, so that all eight are in flight, none begun, when the signal comes
        os.kill(engines[0], signal.SIGSTOP)
        try:
            streams = open_streams(client, prompts, 64)
            srv.proc.send_signal(signal.SIGTERM)
            wait_draining(srv)
            refused = httpx.post(
                srv.url + "/v1/completions", json={"model": "tiny", "prompt": "late", "max_tokens": 4}, timeout=10
            )
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"] == {"message": DRAINING, "type": "server_error", "param": None, "code": None}
            with pytest.raises(openai.InternalServerError, match="the server is draining") as caught:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "late"}])
            assert caught.value.status_code == 503
            assert httpx.post(srv.url + "/generate", json={"text": "late"}).status_code == 503
            assert srv.metric("afd_draining") == 1
            assert [m.id for m in client.models.list().data] == ["tiny"]  # the other routes still answer
        finally:
            os.kill(engines[0], signal.SIGCONT)
        assert [read_stream(s) for s in streams] == undisturbed
        assert srv.proc.wait(timeout=60) == 0
        wait_gone(engines)
        out = srv.proc.communicate(timeout=10)[0]
        assert "draining: new generation requests get 503; 8 in flight may run for up to 60 s" in out
        assert "drained in" in out and "8 request(s) finished, 0 cut at the drain timeout" in out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_second_signal_stops_the_drain_at_once(long_model, sig):
    srv = Server(long_model, "--drain-timeout", "120", "--kv-cache-memory-mb", "64")
    with stopped_after([srv.proc]):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        (stream,) = open_streams(client, ["a very long story"], LONG_TOKENS)
        next(iter(stream))
        engines = engine_pids(srv)
        srv.proc.send_signal(sig)
        wait_draining(srv)
        second = time.monotonic()
        srv.proc.send_signal(sig)
        assert srv.proc.wait(timeout=30) == 128 + sig  # 143 for SIGTERM, 130 for SIGINT
        assert time.monotonic() - second < 5
        wait_gone(engines)
        out = srv.proc.communicate(timeout=10)[0]
        assert "stopped at once by a second signal, without finishing the drain" in out


def test_the_drain_timeout_cuts_what_still_runs(long_model):
    srv = Server(long_model, "--drain-timeout", "1", "--kv-cache-memory-mb", "64")
    with stopped_after([srv.proc]):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        (stream,) = open_streams(client, ["a very long story"], LONG_TOKENS)
        chunks = iter(stream)
        first = next(chunks).choices[0].text
        whole: dict = {}

        def call() -> None:  # a non-streaming request, as long
            body = {"model": "tiny", "prompt": "another long story", "max_tokens": LONG_TOKENS, "ignore_eos": True}
            whole["resp"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            whole["at"] = time.monotonic()

        caller = threading.Thread(target=call)
        caller.start()
        deadline = time.monotonic() + 30
        while srv.metric("afd_num_requests_running") < 2:  # both in the engine
            assert time.monotonic() < deadline
            time.sleep(0.05)
        engines = engine_pids(srv)
        signalled = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        message = (
            "the server shut down before this request finished: it was still running when the drain timeout "
            "(--drain-timeout 1 s) passed"
        )
        text = first
        with pytest.raises(openai.APIError, match=message.replace("(", r"\(").replace(")", r"\)")):
            for chunk in chunks:
                text += "".join(c.text for c in chunk.choices)
        cut = time.monotonic() - signalled
        assert 1 <= cut < 4, f"the stream was cut {cut:.1f} s after SIGTERM"
        assert text  # what came before the cut
        caller.join(timeout=30)
        assert whole["resp"].status_code == 503 and whole["resp"].json()["error"]["message"] == message
        assert 1 <= whole["at"] - signalled < 4
        assert srv.proc.wait(timeout=30) == 0
        exited = time.monotonic() - signalled
        assert exited < 1 + 5, f"the server exited {exited:.1f} s after SIGTERM"
        wait_gone(engines)
        out = srv.proc.communicate(timeout=10)[0]
        assert "0 request(s) finished, 2 cut at the drain timeout" in out


def test_the_router_drains_too(tiny_v3):
    """`afd router` (here in front of one plain instance): the same drain, then exit 0."""
    srv = Server(tiny_v3)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = afd_start("router", "--replica", srv.url, "--port", str(port), "--drain-timeout", "60")
    with stopped_after([router, srv.proc]):
        wait_healthy(url, 60, router)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        (undisturbed,) = [read_stream(s) for s in open_streams(client, ["through the router"], 64)]
        engines = engine_pids(srv)
        os.kill(engines[0], signal.SIGSTOP)
        try:
            (stream,) = open_streams(client, ["through the router"], 64)
            router.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (health := httpx.get(url + "/health", timeout=5)).status_code == 200:
                assert time.monotonic() < deadline, "the router did not start draining"
                time.sleep(0.05)
            assert (health.status_code, health.json()) == (503, {"status": "draining"})
            refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "late"}, timeout=10)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["message"] == DRAINING
            assert "afd_router_draining 1.0" in httpx.get(url + "/metrics").text
        finally:
            os.kill(engines[0], signal.SIGCONT)
        assert read_stream(stream) == undisturbed and undisturbed[1] == 64
        assert router.wait(timeout=60) == 0
        assert httpx.get(srv.url + "/health").status_code == 200  # the instance serves on
        srv.stop()
