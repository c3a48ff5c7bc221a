#!/usr/bin/env python3
"""Soak test: serve for minutes under mixed, partly hostile load, then check nothing leaked or died.

Starts ``afd serve`` (a process group of its own, a free port, the embedded tiny model unless
``--model-path``) in ``--mode single`` or a 1 attention + 1 FFN rank AFD deployment, and runs
``--clients`` concurrent clients for ``--minutes``. Each client loops over requests drawn with a
seeded RNG: chat and completions, streamed or not (``ignore_eos``, so lengths are exact); streams
the client closes after a few chunks and requests it cancels mid-flight; malformed requests
(invalid JSON, lone UTF-16 surrogates in prompt/stop/messages, a tool without a name, too many stop strings,
wrong types, an unknown model), which must get a 4xx with OpenAI's error JSON.

When the load stops and every client has finished its request, it reports:
  * requests by kind, and every non-200 answer by kind, HTTP status and error type;
  * KV pages leaked: ``afd_kv_pages_used`` beyond the prefix cache's own pages
    (``afd_prefix_cache_pages``) on ``/metrics`` once running and waiting are 0;
  * crashed processes: the server and its descendants (found via /proc at start) not alive at the end;
  * RSS growth per process (VmRSS sampled every few seconds): last sample vs the first after the
    warm-up, the first minute or the first fifth of the run, whichever is shorter;
  * p99 end-to-end latency of normal requests in the first and last minute (the first and last
    fifth for runs under five minutes) and its drift.

Exit 1 when a page leaked, a process died, any answer was a 5xx or not JSON, a normal request
failed, a malformed one was accepted, or a process's RSS grew more than ``--max-rss-growth-pct``.

    python -m benchmarks.bench_soak --mode afd --minutes 10 --json soak.json
    python -m benchmarks.bench_soak --quick            # 12 seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from benchmarks.bench_serving import sse_data
from benchmarks.lib.datasets import WORDS
from benchmarks.lib.results import write_json
from benchmarks.lib.server import Server, afd_server

MODES = {
    "single": ["--mode", "single"],
    "afd": ["--mode", "afd", "--dp-size", "1", "--ffn-nodes", "1", "--ffn-ranks-per-node", "1", "--micro-batches", "2"],
}
NORMAL = ("chat", "chat_stream", "completions", "completions_stream")
ABORTS = ("abort_stream", "abort_cancel")
MALFORMED = (
    "invalid_json",
    "surrogate_prompt",
    "surrogate_stop",
    "surrogate_message",
    "tools",
    "oversized_stop",
    "wrong_type",
    "unknown_model",
)
# Share of each request family; malformed kinds take turns within theirs so that a short run sees every one.
WEIGHTS = {"normal": 0.6, "abort_stream": 0.13, "abort_cancel": 0.12, "malformed": 0.15}
MAX_FAILURES_SHOWN = 10


@dataclass
class Outcome:
    """One request as the client saw it. `failure` is set when the answer breaks the contract."""

    kind: str
    start_s: float  # since the load began
    latency_s: float = 0.0
    status: int = 0  # 0: no HTTP answer (cancelled by us, or a transport error)
    error: str = ""  # "<status> <error type>" of a non-200 answer, or a transport error's class
    openai_error: bool = False  # the body was {"error": {"message": str, "type": str, ...}}
    failure: str = ""


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 48)))


def normal_body(kind: str, model: str, rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": rng.choice((0.0, 0.8))}
    body["seed"] = rng.randrange(1 << 30)
    if kind.endswith("stream"):
        body.update(stream=True, stream_options={"include_usage": True})
    if kind.startswith("chat") or (kind in ABORTS and rng.random() < 0.5):
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": _prompt(rng)}]}
    return "/v1/completions", {**body, "prompt": _prompt(rng)}


def malformed_body(kind: str, model: str, rng: random.Random) -> tuple[str, bytes]:
    """A request the server must refuse with a 4xx; streamed half of the time (refused before streaming)."""
    chat = {"model": model, "messages": [{"role": "user", "content": _prompt(rng)}], "max_tokens": 4}
    comp = {"model": model, "prompt": _prompt(rng), "max_tokens": 4, "stream": rng.random() < 0.5}
    chat["stream"] = comp["stream"]
    bodies = {
        "invalid_json": ("/v1/chat/completions", json.dumps(chat)[: rng.randint(1, 30)]),
        "surrogate_prompt": ("/v1/completions", {**comp, "prompt": "abc \ud800 def"}),
        "surrogate_stop": ("/v1/chat/completions", {**chat, "stop": ["ok", "\udfff"]}),
        "surrogate_message": ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x\ud83dy"}]}),
        "tools": ("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {"description": "f"}}]}),
        "oversized_stop": ("/v1/completions", {**comp, "stop": [f"s{i}" for i in range(rng.randint(5, 64))]}),
        "wrong_type": ("/v1/chat/completions", rng.choice([{**chat, "messages": "hi"}, {**chat, "max_tokens": "ten"}])),
        "unknown_model": ("/v1/completions", {**comp, "model": "no-such-model"}),
    }
    path, body = bodies[kind]
    # json.dumps escapes a lone surrogate as \ud800: valid JSON text holding invalid Unicode.
    return path, (body if isinstance(body, str) else json.dumps(body)).encode()


def _check_error_answer(out: Outcome, status: int, raw: bytes) -> None:
    """Records a non-200 answer; 5xx and bodies that are not OpenAI's error JSON are failures."""
    out.status = status
    try:
        err = json.loads(raw)["error"]
        out.openai_error = isinstance(err["message"], str) and isinstance(err["type"], str)
        out.error = f"{status} {err['type']}"
    except (ValueError, KeyError, TypeError):
        out.error = f"{status} non-JSON"
    if status >= 500:
        out.failure = f"HTTP {status}: {raw[:200]!r}"
    elif not out.openai_error:
        out.failure = f"HTTP {status} without OpenAI error JSON: {raw[:200]!r}"


async def _read_stream(response: httpx.Response, out: Outcome, max_tokens: int, stop_after: int | None) -> None:
    """Reads SSE chunks; with `stop_after`, returns after that many (leaving the caller's `async with`
    then closes the connection, which the server must take as an abort)."""
    chunks = 0
    async for data in sse_data(response):
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            out.failure = f"stream error event: {data[:200]}"
            return
        if chunk.get("usage") and chunk["usage"]["completion_tokens"] != max_tokens:
            out.failure = f"usage says {chunk['usage']['completion_tokens']} tokens, asked {max_tokens}"
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            out.error = "closed by the client"
            return
    if stop_after is None:
        out.failure = "the stream ended without [DONE]"


async def send_normal(client: httpx.AsyncClient, out: Outcome, path: str, body: dict, stop_after=None) -> None:
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            _check_error_answer(out, response.status_code, await response.aread())
            out.failure = out.failure or f"a valid request got {out.error}"
            return
        out.status = 200
        if body.get("stream"):
            await _read_stream(response, out, body["max_tokens"], stop_after)
            return
        usage = json.loads(await response.aread())["usage"]
        if usage["completion_tokens"] != body["max_tokens"]:
            out.failure = f"usage says {usage['completion_tokens']} tokens, asked {body['max_tokens']}"


async def send_malformed(client: httpx.AsyncClient, out: Outcome, path: str, raw: bytes) -> None:
    response = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
    if response.status_code < 400:
        out.status, out.failure = response.status_code, f"malformed request accepted: {response.status_code}"
        return
    _check_error_answer(out, response.status_code, response.content)
    if response.status_code < 500 and not out.failure and not out.openai_error:
        out.failure = "4xx without OpenAI error JSON"


async def one_request(client: httpx.AsyncClient, model: str, rng: random.Random, kind: str, t0: float, args):
    out = Outcome(kind, time.perf_counter() - t0)
    try:
        if kind.startswith("malformed:"):
            await send_malformed(client, out, *malformed_body(kind.split(":", 1)[1], model, rng))
        elif kind == "abort_stream":  # leaving the `async with` early closes the connection
            path, body = normal_body(kind, model, rng, args.abort_max_tokens)
            await send_normal(client, out, path, body, stop_after=rng.randint(1, 6))
        elif kind == "abort_cancel":  # the client gives up mid-flight: the task is cancelled
            path, body = normal_body(kind, model, rng, args.abort_max_tokens)
            try:
                await asyncio.wait_for(send_normal(client, out, path, body), timeout=rng.uniform(0.02, 0.5))
            except asyncio.TimeoutError:
                out.error = "cancelled by the client"
        else:
            await send_normal(client, out, *normal_body(kind, model, rng, args.max_tokens))
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as exc:
        out.error, out.failure = type(exc).__name__, f"{type(exc).__name__}: {exc}"
    out.latency_s = time.perf_counter() - t0 - out.start_s
    return out


def _next_kind(rng: random.Random, turn: int) -> str:
    family = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    if family == "normal":
        return rng.choice(NORMAL)
    return f"malformed:{MALFORMED[turn % len(MALFORMED)]}" if family == "malformed" else family


async def client_loop(client, model: str, cid: int, t0: float, deadline: float, args) -> list[Outcome]:
    rng = random.Random(args.seed * 1000 + cid)
    outcomes, turn = [], cid
    while time.perf_counter() < deadline:
        kind = _next_kind(rng, turn)
        turn += kind.startswith("malformed:")
        outcomes.append(await one_request(client, model, rng, kind, t0, args))
    return outcomes


# ---------------------------------------------------------------------------------------------
# Processes: the server's tree from /proc, liveness and RSS
# ---------------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in ticks) from /proc/PID/stat, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[19])


def process_tree(root: int) -> dict[int, dict]:
    """The root and all its descendants: pid -> {"name", "start"} (start tells a reused pid apart)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))):
            parents[int(entry.name)] = st[1]
    tree, frontier = {root}, [root]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier and p not in tree]
        tree.update(kids)
        frontier = kids
    procs, ranks = {}, 0
    for pid in sorted(tree):  # pids grow with spawn order: the launcher starts FFN ranks first
        if st := _stat(pid):
            name = _describe(pid, root)
            if name == "rank":
                ranks += 1
                name = f"rank process {ranks} (spawn order)"
            procs[pid] = {"name": name, "start": st[2]}
    return procs


def _describe(pid: int, root: int) -> str:
    if pid == root:
        return "afd serve (API server)"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    if "resource_tracker" in cmd:
        return "resource_tracker"
    return "forkserver" if "forkserver" in cmd else "rank"  # ranks fork from it (processes/rank_process.py)


def alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == start and st[0] not in ("Z", "X")


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


async def sample_rss(procs: dict[int, dict], t0: float, every_s: float, samples: dict[int, list]) -> None:
    while True:
        now = time.perf_counter() - t0
        for pid in procs:
            if (kb := rss_kb(pid)) is not None:
                samples[pid].append((now, kb))
        await asyncio.sleep(every_s)


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


def start_server(args, log_path: Path) -> Server:
    """`afd serve` in a session of its own (its whole tree is found and signalled as one group, and
    only ours), output to `log_path`."""
    flags = ["serve", "--num-threads", "1", *MODES[args.mode]]
    return afd_server(*flags, *(["--model-path", args.model_path] if args.model_path else []), log_path=log_path)


def _held_pages(gauges: dict[str, float]) -> float:
    """KV pages held by requests (the prefix cache's own pages are kept on purpose), plus any
    request still running or waiting: 0 once the server has drained."""
    held = gauges.get("afd_kv_pages_used", 0.0) - gauges.get("afd_prefix_cache_pages", 0.0)
    return held + gauges.get("afd_num_requests_running", 0.0) + gauges.get("afd_num_requests_waiting", 0.0)


async def kv_after_drain(client: httpx.AsyncClient, timeout_s: float) -> tuple[dict[str, float], float]:
    """Polls /metrics until nothing runs, waits or holds KV pages (or the timeout); returns the gauges."""
    start = time.perf_counter()
    while True:
        try:
            text = (await client.get("/metrics")).text
        except httpx.HTTPError:
            return {}, time.perf_counter() - start  # the server is gone: nothing is known
        gauges = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in (
                "afd_kv_pages_used",
                "afd_prefix_cache_pages",
                "afd_num_requests_running",
                "afd_num_requests_waiting",
            ):
                gauges[name] = float(value)
        waited = time.perf_counter() - start
        if not _held_pages(gauges) or waited > timeout_s:
            return gauges, waited
        await asyncio.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# The run and its report
# ---------------------------------------------------------------------------------------------


async def soak(args, base: str, procs: dict[int, dict]) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits, trust_env=False) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        samples: dict[int, list] = {pid: [] for pid in procs}
        t0 = time.perf_counter()
        sampler = asyncio.create_task(sample_rss(procs, t0, args.sample_every_s, samples))
        deadline = t0 + args.minutes * 60
        loops = [client_loop(client, model, c, t0, deadline, args) for c in range(args.clients)]
        outcomes = [o for per_client in await asyncio.gather(*loops) for o in per_client]
        duration = time.perf_counter() - t0
        gauges, drain_s = await kv_after_drain(client, args.drain_timeout_s)
        sampler.cancel()
        try:
            healthy = (await client.get("/health")).status_code == 200
        except httpx.HTTPError:
            healthy = False
    return {
        "outcomes": outcomes,
        "duration": duration,
        "gauges": gauges,
        "drain_s": drain_s,
        "samples": samples,
        "healthy": healthy,
    }


def latency_drift(outcomes: list[Outcome], duration: float) -> dict:
    window = 60.0 if duration >= 300 else duration / 5
    ok = [o for o in outcomes if o.kind in NORMAL and not o.failure]
    first = [o.latency_s * 1000 for o in ok if o.start_s < window]
    last = [o.latency_s * 1000 for o in ok if o.start_s >= duration - window]
    p99 = [float(np.percentile(xs, 99)) if xs else None for xs in (first, last)]
    drift = (p99[1] - p99[0]) / p99[0] * 100 if None not in p99 else None
    return {
        "window_s": window,
        "first_n": len(first),
        "last_n": len(last),
        "first_p99_ms": p99[0],
        "last_p99_ms": p99[1],
        "p99_drift_pct": drift,
    }


def memory_report(procs: dict[int, dict], samples: dict[int, list], duration: float) -> list[dict]:
    warmup = min(60.0, duration / 5)
    rows = []
    for pid, info in procs.items():
        after = [kb for t, kb in samples[pid] if t >= warmup]
        base, last = (after[0], after[-1]) if after else (None, None)
        growth = (last - base) / base * 100 if base else None
        rss = [kb for _, kb in samples[pid]]
        rows.append(
            {
                "pid": pid,
                "process": info["name"],
                "warmup_s": warmup,
                "rss_after_warmup_kb": base,
                "rss_last_kb": last,
                "rss_peak_kb": max(rss, default=None),
                "rss_growth_pct": growth,
            }
        )
    return rows


def build_report(args, procs: dict[int, dict], run: dict) -> dict:
    outcomes: list[Outcome] = run["outcomes"]
    requests = {k: Counter() for k in (*NORMAL, *ABORTS, *(f"malformed:{m}" for m in MALFORMED))}
    errors: dict[str, Counter] = {}
    for o in outcomes:
        requests[o.kind]["sent"] += 1
        requests[o.kind]["ok"] += not o.failure
        requests[o.kind]["4xx_openai_error"] += 400 <= o.status < 500 and o.openai_error
        if o.error:
            errors.setdefault(o.kind, Counter())[o.error] += 1
    failures = [f"{o.kind}: {o.failure}" for o in outcomes if o.failure]
    for pid, info in procs.items():
        info["alive"] = alive(pid, info["start"])
    crashed = [pid for pid, info in procs.items() if not info["alive"]]
    memory = memory_report(procs, run["samples"], run["duration"])
    gauges = run["gauges"]
    leaked = gauges["afd_kv_pages_used"] - gauges.get("afd_prefix_cache_pages", 0.0) if gauges else None
    reasons = []
    if leaked is None:
        reasons.append("/metrics did not answer after the load: KV pages unknown")
    elif leaked:
        reasons.append(f"{leaked:.0f} KV pages still in use {run['drain_s']:.1f} s after the load")
    if crashed or not run["healthy"]:
        reasons.append(f"{len(crashed)} processes died; /health {'ok' if run['healthy'] else 'failing'}")
    if failures:
        reasons.append(f"{len(failures)} requests broke the contract (5xx, non-JSON, failed or accepted)")
    for m in memory:
        if m["rss_growth_pct"] is not None and m["rss_growth_pct"] > args.max_rss_growth_pct:
            reasons.append(f"pid {m['pid']} ({m['process']}) RSS grew {m['rss_growth_pct']:.1f}%")
    return {
        "settings": {k: v for k, v in vars(args).items()},
        "duration_s": run["duration"],
        "requests": {k: dict(c) for k, c in requests.items()},
        "errors": {k: dict(c) for k, c in errors.items()},
        "failures": len(failures),
        "failure_examples": failures[:MAX_FAILURES_SHOWN],
        "kv": {**run["gauges"], "drain_s": run["drain_s"], "leaked_pages": leaked},
        "processes": [{"pid": pid, **info} for pid, info in procs.items()],
        "crashed_processes": len(crashed),
        "memory": memory,
        "latency": latency_drift(outcomes, run["duration"]),
        "passed": not reasons,
        "reasons": reasons,
    }


def _fmt(value, spec: str = ".1f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def format_report(r: dict) -> str:
    s = r["settings"]
    lines = [
        "{:=^78}".format(" Soak Benchmark Result "),
        f"mode {s['mode']}, {s['clients']} clients, seed {s['seed']}, {r['duration_s']:.1f} s of load",
        "{:-^78}".format(" requests (sent / ok) "),
    ]
    lines += [f"  {k:<30}{c.get('sent', 0):>10}{c.get('ok', 0):>10}" for k, c in r["requests"].items()]
    lines.append("{:-^78}".format(" non-200 answers and client-side ends, by kind "))
    for kind, counts in r["errors"].items():
        lines += [f"  {kind:<30}{err:<36}{n:>10}" for err, n in sorted(counts.items())]
    lines.append("{:-^78}".format(" health "))
    lines.append(f"  contract failures (5xx, non-JSON, failed/accepted)  {r['failures']}")
    kv = r["kv"]
    lines.append(
        f"  KV pages leaked                     {_fmt(kv['leaked_pages'], '.0f')} (drained in {kv['drain_s']:.1f} s)"
    )
    lines.append(f"  crashed processes                   {r['crashed_processes']} of {len(r['processes'])}")
    lines.append("{:-^78}".format(f" RSS (MiB) after {r['memory'][0]['warmup_s']:.0f} s warm-up -> end "))
    for m in r["memory"]:
        mib = [None if m[k] is None else m[k] / 1024 for k in ("rss_after_warmup_kb", "rss_last_kb", "rss_peak_kb")]
        lines.append(
            f"  pid {m['pid']:<8}{m['process']:<28}{_fmt(mib[0]):>9} ->{_fmt(mib[1]):>9}  "
            f"{_fmt(m['rss_growth_pct'], '+.2f', '%'):>8}  peak {_fmt(mib[2])}"
        )
    lat = r["latency"]
    lines.append("{:-^78}".format(f" p99 latency of normal requests, first vs last {lat['window_s']:.0f} s "))
    lines.append(
        f"  {_fmt(lat['first_p99_ms'])} ms (n={lat['first_n']}) -> {_fmt(lat['last_p99_ms'])} ms "
        f"(n={lat['last_n']}), drift {_fmt(lat['p99_drift_pct'], '+.1f', '%')}"
    )
    lines.append("=" * 78)
    lines.append("PASS" if r["passed"] else "FAIL: " + "; ".join(r["reasons"]))
    lines += [f"  e.g. {f}" for f in r["failure_examples"]]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=sorted(MODES), default="afd")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--quick", action="store_true", help="12 seconds of load, RSS sampled every second")
    p.add_argument("--model-path", default=None, help="checkpoint (default: the embedded tiny model)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients, one request in flight each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per normal request")
    p.add_argument("--abort-max-tokens", type=int, default=64, help="tokens asked by requests the client aborts")
    p.add_argument("--sample-every-s", type=float, default=5.0, help="RSS sampling period")
    p.add_argument("--max-rss-growth-pct", type=float, default=5.0)
    p.add_argument("--drain-timeout-s", type=float, default=30.0, help="wait this long for KV pages to return")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.sample_every_s = 12 / 60, 1.0
    if args.minutes <= 0 or args.clients < 1:
        p.error("--minutes must be positive and --clients at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="afd-soak-") as tmp:
        with start_server(args, Path(tmp) / "serve.log") as server:
            procs = process_tree(server.pid)
            run = asyncio.run(soak(args, server.url, procs))
            report = build_report(args, procs, run)
        if report["crashed_processes"]:
            print(server.log_tail(4000), file=sys.stderr)
    print(format_report(report), flush=True)
    if args.json:
        write_json(args.json, report)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
