"""`afd router`'s failover (server/pd_failover.py): a resumed request goes on as if it had never
moved; a decode instance killed mid-stream and a prefill instance killed with requests queued on
it cost the clients nothing; the surviving instances end idle."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time

import httpx
import pytest

from afd_engine import Engine, SamplingParams
from afd_engine.disagg.bootstrap import BootstrapServer
from afd_engine.errors import InvalidRequestError
from afd_engine.processes.rendezvous import free_port as free_local_port
from tests.disagg.pd_helpers import COMMON, idle_pages
from tests.disagg.test_pd_serve import kill_tree, wait_idle
from tests.process_helpers import afd_start, free_port, proc_title, stopped_after, wait_healthy
from tests.server.conftest import Server
from tests.server.test_engine_death import children

INSTANCE = ("--max-num-batched-tokens", "16")


def prefill_server(path: str) -> Server:
    port = str(free_port())
    return Server(path, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", port, *INSTANCE)


class Pair:
    """A prefill and a decode engine in this process, driven by hand as the router drives two
    instances (a request's "resume" goes to both)."""

    def __init__(self, path: str) -> None:
        common = {**COMMON, "model_path": path}
        self.p = Engine(**common, disaggregation_mode="prefill")
        self.d = Engine(**common, disaggregation_mode="decode")
        port = free_local_port("127.0.0.1")
        self.bootstrap = BootstrapServer("127.0.0.1", port, [self.p.disagg.address], self.p.disagg.description)
        self.address = f"127.0.0.1:{port}"
        self.rooms = itertools.count(1 << 20, 1 << 8)

    def run(self, prompt: list[int], params: SamplingParams, resume: list[int] | None = None) -> list:
        room = next(self.rooms)
        extra = {} if resume is None else {"resume": resume}
        self.d.add_request(
            prompt_token_ids=prompt, params=params, disaggregation={"room": room, "bootstrap": self.address, **extra}
        )
        self.p.add_request(prompt_token_ids=prompt, params=params, disaggregation={"room": room, **extra})
        updates, deadline = [], time.monotonic() + 30
        while self.d.has_unfinished() or self.p.has_unfinished():
            assert time.monotonic() < deadline
            self.p.step()
            updates += self.d.step_updates()
        return updates

    def close(self) -> None:
        self.bootstrap.close()
        self.p.close()
        self.d.close()


def test_a_resumed_request_goes_on_as_if_it_had_never_moved(tiny_v3):
    """From any point, the tokens a resumed request adds are the rest of the undisturbed run's:
    greedy, and seeded with a penalty over the tokens so far and a minimum length (both count the
    resumed tokens); the updates count the whole output; nothing stays held on either side."""
    pair = Pair(tiny_v3)
    prompt = list(range(5, 45))
    try:
        for params in (
            SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
            SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7, presence_penalty=1.5, min_tokens=9),
        ):
            whole = [t for u in pair.run(prompt, params) for t in u.token_ids]
            assert len(whole) == 12
            for k in (1, 5, 11):
                updates = pair.run(prompt, params, resume=whole[:k])
                assert [t for u in updates for t in u.token_ids] == whole[k:]
                last = updates[-1]
                assert (last.num_prompt_tokens, last.num_output_tokens, last.finish_reason) == (40, 12, "length")
        assert idle_pages(pair.p) and idle_pages(pair.d) and pair.d.disagg.reserved_pages == 0
        with pytest.raises(InvalidRequestError, match="nothing is left to generate"):
            pair.d.add_request(
                prompt_token_ids=prompt,
                params=SamplingParams(max_new_tokens=2),
                disaggregation={"room": 8, "bootstrap": pair.address, "resume": [1, 2]},
            )
    finally:
        pair.close()


class Router:
    def __init__(self, prefill: list[Server], decode: list[Server]) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        flags = [f for s in prefill for f in ("--prefill", s.url)] + [f for s in decode for f in ("--decode", s.url)]
        self.proc = afd_start("router", *flags, "--port", self.url.rsplit(":", 1)[1])
        wait_healthy(self.url, 60, self.proc)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics").text

    def in_flight(self, srv: Server) -> float:
        line = f'afd_router_in_flight{{instance="{srv.url}"}}'
        return next((float(m.rsplit(" ", 1)[1]) for m in self.metrics().splitlines() if m.startswith(line)), 0.0)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)


# what the tests send: chats and completions, greedy and seeded, streamed and not, and /generate;
# sent one after another, the even ones go to the first decode instance (the router's tie-break)
REQUESTS = {
    "chat-two-choices": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "two ways " * 5}], "temperature": 0.8, "seed": 2, "n": 2},
    ),
    "chat-seeded": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "another one " * 5}], "temperature": 0.8, "seed": 11},
    ),
    "generate-seeded": (
        "/generate",
        {"text": "native text " * 6, "sampling_params": {"temperature": 0.9, "seed": 3, "ignore_eos": True}},
    ),
    "completion-seeded": ("/v1/completions", {"prompt": "once upon a time " * 4, "temperature": 0.7, "seed": 5}),
    "completion-greedy": ("/v1/completions", {"prompt": "the end of it all " * 4}),
    "chat-greedy": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tell a story " * 5}]}),
    "whole": ("/v1/completions", {"prompt": "no stream here " * 4, "stream": False}),
}


def request_body(name: str, max_tokens: int) -> tuple[str, dict]:
    path, body = REQUESTS[name]
    if path == "/generate":
        params = {**body["sampling_params"], "max_new_tokens": max_tokens}
        return path, {**body, "sampling_params": params, "stream": True}
    out = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True, **body}
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    return path, out


STREAMS = [name for name in REQUESTS if name != "whole"]


def call(url: str, name: str, max_tokens: int, got: dict, events: threading.Semaphore | None = None) -> None:
    """One request; got[name] = ({choice index: text}, chunk ids, usage, errors). A stream releases
    `events` once it has read 8 events; one that does not end with `data: [DONE]` has an error, and
    so has a request whose reading raised (a broken connection, an event that is not JSON)."""
    try:
        _call(url, name, max_tokens, got, events)
    except Exception as exc:  # (recorded, so that the test's assertion names it)
        got[name] = ({}, set(), None, [f"raised {exc!r}"])


def _call(url: str, name: str, max_tokens: int, got: dict, events: threading.Semaphore | None) -> None:
    path, body = request_body(name, max_tokens)
    text, ids, usage, errors = {}, set(), None, []
    with httpx.Client(timeout=120) as client:
        if not body["stream"]:
            resp = client.post(url + path, json=body)
            try:
                answer = resp.json()
            except ValueError:  # (not JSON: say what came, status and body)
                answer = {"error": f"status {resp.status_code}, not JSON: {resp.text[:300]!r}"}
            if "error" in answer:
                errors.append(answer["error"])
            else:
                text, ids, usage = {0: answer["choices"][0]["text"]}, {answer["id"]}, answer["usage"]
            got[name] = (text, ids, usage, errors)
            return
        with client.stream("POST", url + path, json=body) as resp:
            lines = []
            for line in resp.iter_lines():
                lines += [line] if line else []
                if len(lines) == 8 and events is not None:
                    events.release()
    if lines[-1:] != ["data: [DONE]"] or lines.count("data: [DONE]") != 1:
        errors.append(f"the stream ends with {lines[-1:]}")
    for line in lines[:-1]:
        if not line.startswith("data: "):  # (a comment line must not reach the client either)
            errors.append(line)
            continue
        event = json.loads(line[6:])
        if "error" in event:
            errors.append(event["error"])
        elif path == "/generate":
            text[0] = text.get(0, "") + event["text"]
            usage = {k: event["meta_info"][k] for k in ("prompt_tokens", "completion_tokens")}
        else:
            ids.add(event["id"])
            usage = event.get("usage") or usage
            for c in event["choices"]:
                piece = c["delta"].get("content") or "" if "delta" in c else c["text"]
                text[c["index"]] = text.get(c["index"], "") + piece
    got[name] = (text, ids, usage, errors)


def run_all(url: str, names, max_tokens: int, events: threading.Semaphore | None = None, placed=None) -> dict:
    """Starts the requests, each once `placed(i)` (i requests started so far) holds."""
    got: dict = {}
    threads = [threading.Thread(target=call, args=(url, n, max_tokens, got, events)) for n in names]
    for i, t in enumerate(threads):
        t.start()
        deadline = time.monotonic() + 30
        while placed is not None and not placed(i + 1):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    return got, threads


def join(threads) -> None:
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()


def assert_undisturbed(got: dict, want: dict) -> None:
    for name, (text, ids, usage, _) in want.items():
        assert got[name][3] == [], (name, got[name][3])
        assert got[name][0] == text, name
        assert len(got[name][1]) == len(ids), name  # one id throughout the stream
        if usage is not None:  # prompt_tokens the original prompt's, completion_tokens every token
            assert {k: got[name][2][k] for k in ("prompt_tokens", "completion_tokens")} == {
                k: usage[k] for k in ("prompt_tokens", "completion_tokens")
            }, name


def metric(text: str, name: str) -> float:
    """The sum of the samples whose line starts with `name` (every label value of a counter)."""
    return sum(float(m.rsplit(" ", 1)[1]) for m in text.splitlines() if m.startswith(name))


# A stream's length in the kill test: its requests are placed one at a time (each once the router
# counts the one before), which took about 0.1 s each on the 2-core machine, and a 300-token stream
# of the tiny model could end (0.5 s) before the seventh was placed. Long streams need a longer
# context than the tiny model's 512 tokens.
KILL_TEST_TOKENS = 1500


@pytest.fixture(scope="module")
def long_v3(tmp_path_factory) -> str:
    """The tiny DeepSeek-V3 checkpoint with a 2,048-token context."""
    from afd_engine.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp("v3-long")
    return str(make_tiny_model(out, overrides={"max_position_embeddings": 2048}))


@pytest.mark.timeout(600)
def test_a_decode_instance_killed_mid_stream_costs_the_clients_nothing(long_v3):
    """One prefill and two decode instances; kill -9 of one decode instance while streams (chat,
    completions, /generate; greedy and seeded; a chat of two choices) and a JSON request run on
    both: every request ends with the text of the undisturbed run, no error event, one stream id,
    usage counted once for the original prompt and all tokens; the surviving instances end idle."""
    prefill = prefill_server(long_v3)
    started = [prefill]
    try:
        decode = [Server(long_v3, "--disaggregation-mode", "decode", *INSTANCE) for _ in range(2)]
        started += decode
        router = Router([prefill], decode)
        started.append(router)
        names = list(REQUESTS)
        with stopped_after([router.proc]):  # (a failure shows the router's log)
            want, threads = run_all(router.url, names, KILL_TEST_TOKENS)
            join(threads)
            assert all(not w[3] for w in want.values()), want

            events = threading.Semaphore(0)
            placed = lambda n: sum(router.in_flight(d) for d in decode) == n  # noqa: E731
            got, threads = run_all(router.url, names, KILL_TEST_TOKENS, events, placed)
            for _ in STREAMS:
                assert events.acquire(timeout=60)
            # the chat of two choices, /generate, a greedy completion and the JSON request run there
            assert router.in_flight(decode[0]) == 4
            kill_tree(decode[0].proc)
            join(threads)
            assert_undisturbed(got, want)
            metrics = router.metrics()
            # the three streams resumed, the JSON request sent again
            assert metric(metrics, 'afd_router_failovers_total{kind="resume"}') == 3
            assert metric(metrics, 'afd_router_failovers_total{kind="resend"}') == 1
            assert metric(metrics, f'afd_router_instance_up{{instance="{decode[0].url}"}}') == 0
            wait_idle(prefill, decode[1])
            assert decode[1].metric("afd_kv_pages_reserved") == 0
    finally:
        for s in started:
            if s.proc.poll() is None:
                s.stop()


@pytest.mark.timeout(600)
def test_a_prefill_instance_killed_with_requests_queued_hands_them_to_another(tiny_v3):
    """Two prefill instances and one decode instance; requests queue on a prefill instance whose
    rank does not run, then it is killed: they complete through the other one, paired again with
    the decode instance, with the undisturbed run's text; the decode instance frees the pages it
    had reserved for the lost transfers, and both survivors end idle."""
    prefill = [prefill_server(tiny_v3) for _ in range(2)]
    started = list(prefill)
    try:
        decode = Server(tiny_v3, "--disaggregation-mode", "decode", *INSTANCE)
        started.append(decode)
        router = Router(prefill, [decode])
        started.append(router)
        names = list(REQUESTS)
        with stopped_after([router.proc]):  # (a failure shows the router's log)
            want, threads = run_all(router.url, names, 40)
            join(threads)
            assert all(not w[3] for w in want.values()), want

            (rank,) = [p for p in children(prefill[0].proc.pid) if proc_title(p) == "afd::engine"]
            os.kill(rank, signal.SIGSTOP)  # its requests queue: the rank never takes them
            got, threads = run_all(router.url, names, 40)
            deadline = time.monotonic() + 30
            while router.in_flight(prefill[0]) < 2 or decode.metric("afd_kv_pages_reserved") == 0:
                assert time.monotonic() < deadline, "no request waits on the stopped prefill instance"
                time.sleep(0.05)
            os.kill(rank, signal.SIGKILL)
            kill_tree(prefill[0].proc)
            join(threads)
            assert_undisturbed(got, want)
            assert metric(router.metrics(), "afd_router_failovers_total") >= 2
            wait_idle(prefill[1], decode)
            assert decode.metric("afd_kv_pages_reserved") == 0
    finally:
        for s in started:
            if s.proc.poll() is None:
                s.stop()
