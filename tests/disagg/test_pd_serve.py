"""PD over HTTP: `afd serve --pd` driven by the official openai client; `afd router` in front of
instances started apart, and what happens to each side when the client leaves, the decode
instance dies, or the prefill instance dies mid-request."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from afd_engine import Engine, SamplingParams
from tests.process_helpers import afd_start, free_port, proc_title, wait_healthy
from tests.server.conftest import Server
from tests.server.test_engine_death import children

IGNORE_EOS = {"ignore_eos": True}


def kill_tree(proc) -> None:
    for pid in [*children(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)


class Router:
    def __init__(self, prefill: Server, decode: Server) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        self.proc = afd_start("router", "--prefill", prefill.url, "--decode", decode.url, "--port", port)
        wait_healthy(self.url, 60, self.proc)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def idle(srv: Server) -> bool:
    return srv.metric("afd_num_requests_running") == 0 and srv.metric("afd_kv_pages_used") == srv.metric(
        "afd_prefix_cache_pages"
    )


def wait_idle(*servers: Server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(idle(s) for s in servers):
        assert time.monotonic() < deadline, "pages were not freed"
        time.sleep(0.1)


@pytest.mark.timeout(300)
def test_serve_pd_one_command_matches_the_single_engine(tiny_v3):
    prompts = ["Hello disaggregation", "Second prompt, a little longer than the first one"]
    with Engine(model_path=tiny_v3, num_threads=1) as single:
        ref = single.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
        greedy5 = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
        short = single.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=greedy5)[0]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = afd_start(
        "serve", "--pd", "--prefill-mode", "single", "--decode-mode", "single",
        "--model-path", tiny_v3, "--port", str(port), "--num-threads", "1", "--kv-cache-memory-mb", "16",
        "--served-model-name", "tiny", "--max-num-batched-tokens", "8", "--local-prefill-max-tokens", "4",
    )  # fmt: skip
    try:
        wait_healthy(url, 180, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.completions.create(
            model="tiny", prompt=prompts, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        assert [c.text for c in out.choices] == [r.text for r in ref]
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        assert chunks[-1].usage.completion_tokens == 6
        meta = httpx.post(
            url + "/generate",
            json={"text": prompts[1], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}},
        ).json()["meta_info"]
        assert set(meta["timeline"]) == {
            "queue_s", "prefill_s", "transfer_s", "transfer_bytes", "kv_wait_s", "first_decode_step_s"
        }  # fmt: skip
        assert meta["timeline"]["transfer_bytes"] > 0 and meta["completion_tokens"] == 4
        # prompts of at most 4 tokens (the chat's "hi", these ids) were prefilled by the decode instance
        local = httpx.post(
            url + "/generate",
            json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 5, "temperature": 0, **IGNORE_EOS}},
        ).json()
        assert local["output_ids"] == short.token_ids and "transfer_s" not in local["meta_info"].get("timeline", {})
        metrics = httpx.get(url + "/metrics").text
        assert 'afd_router_requests_total{endpoint="completions",status="ok"} 1.0' in metrics
        assert "afd_router_local_prefills_total 2.0" in metrics
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def stream_some(url: str, max_tokens: int, chunks: int = 3):
    """A streaming chat through the router, `chunks` events read; returns (client, stream)."""
    client = httpx.Client(timeout=30)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "a long story " * 8}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    ctx = client.stream("POST", url + "/v1/chat/completions", json=body)
    resp = ctx.__enter__()
    lines = resp.iter_lines()
    got = 0
    while got < chunks:
        if next(lines).startswith("data: "):
            got += 1
    return client, ctx, lines


@pytest.mark.timeout(400)
def test_failures_fail_the_request_and_free_both_sides(tiny_v3):
    boot = free_port()
    common = ("--max-num-batched-tokens", "16")
    prefill = Server(tiny_v3, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot), *common)
    decode = Server(tiny_v3, "--disaggregation-mode", "decode", *common)
    started = [prefill, decode]
    try:
        # 0. what each instance refuses or fails on its own, as OpenAI errors
        gen = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 2}}
        plain = httpx.post(prefill.url + "/generate", json=gen)
        assert plain.status_code == 400
        assert "its requests come through `afd router`" in plain.json()["error"]["message"]
        nobody = free_port()
        lost = httpx.post(
            decode.url + "/generate",
            json={**gen, "bootstrap_host": "127.0.0.1", "bootstrap_port": nobody, "bootstrap_room": 64},
            timeout=30,
        )
        assert lost.status_code == 503
        assert lost.json()["error"]["message"] == (
            f"the engine is unavailable: the prefill instance's bootstrap server at 127.0.0.1:{nobody} "
            "did not answer within 2 s"
        )
        router = Router(prefill, decode)
        started.append(router)
        # 1. the client goes away mid-stream: both sides drop the request
        client, ctx, _ = stream_some(router.url, 300)
        ctx.__exit__(None, None, None)
        client.close()
        wait_idle(prefill, decode)

        # 2. the decode instance dies mid-stream: an error event; the prefill side is idle and serving
        client, ctx, lines = stream_some(router.url, 400)
        kill_tree(decode.proc)
        rest = [line for line in lines if line]
        ctx.__exit__(None, None, None)
        assert any('"error"' in line for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        wait_idle(prefill)
        assert httpx.get(prefill.url + "/health").status_code == 200

        # 3. the prefill instance dies mid-request: an OpenAI error within 2 s; the decode side frees
        # the pages it reserved and goes on serving (a new decode instance where the router knows one)
        decode = Server(tiny_v3, "--disaggregation-mode", "decode", *common, port=decode.port)
        started.append(decode)
        (rank,) = [p for p in children(prefill.proc.pid) if proc_title(p) == "afd::engine"]
        os.kill(rank, signal.SIGSTOP)  # the request reaches the prefill rank, which never answers
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30)
        import threading

        result = {}

        def call():
            try:
                client.completions.create(model="tiny", prompt="the prefill side dies", max_tokens=5)
            except openai.APIError as exc:
                result["error"], result["at"] = exc, time.monotonic()

        caller = threading.Thread(target=call)
        caller.start()
        deadline = time.monotonic() + 10
        while decode.metric("afd_kv_pages_reserved") == 0:  # the decode side holds its pages
            assert time.monotonic() < deadline
            time.sleep(0.05)
        killed = time.monotonic()
        os.kill(rank, signal.SIGKILL)
        kill_tree(prefill.proc)
        caller.join(timeout=10)
        assert "the prefill instance" in str(result["error"])
        assert result["at"] - killed < 2.0
        wait_idle(decode)
        assert decode.metric("afd_kv_pages_reserved") == 0
        assert httpx.get(decode.url + "/health").status_code == 200
    finally:
        for s in started:
            if s.proc.poll() is None:
                s.stop()
