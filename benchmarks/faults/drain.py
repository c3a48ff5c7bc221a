"""Scenario `drain`: SIGTERM reaches `afd serve` while long streams run (--drain-timeout).

`--concurrency` streams of `--output-len` tokens, one per prompt, run once undisturbed (for
reference), then again; once each has a quarter of its tokens the server's process (alone, as
Kubernetes and `docker stop` signal it) gets SIGTERM. While streams remain, a new request every
PROBE_EVERY_S on a new connection must get 503 with Retry-After, and /health must answer draining;
the streams must all complete with their undisturbed tokens, and the server exit with status 0.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx

from benchmarks.faults.attention import DEPLOYMENT, server_flags
from benchmarks.faults.streams import (
    consistent,
    failures,
    format_streams,
    http_client,
    make_prompts,
    stream_figures,
    stream_one,
)
from benchmarks.lib.server import Server, ServerNotReady, afd_server

DEFAULTS = {"deployment": DEPLOYMENT, "output_len": 256}
QUICK = {"output_len": 128, "drain_timeout": 30.0}
PROBE_EVERY_S = 0.2
SIGNAL_AT = 0.25  # of every stream's tokens


def run(args, logdir: str) -> dict:
    try:
        flags = [*server_flags(args), "--drain-timeout", f"{args.drain_timeout:g}"]
        server = afd_server("serve", *flags, log_path=Path(logdir) / "serve.log")
    except ServerNotReady as exc:
        raise RuntimeError(f"{exc}\nlogs in {logdir}") from None
    try:
        return asyncio.run(_run(args, server))
    finally:
        server.stop()  # (it has exited: what of its process group is left)


async def _run(args, server: Server) -> dict:
    prompts = make_prompts(args.concurrency)
    out = args.output_len
    async with http_client(server.url) as client:
        undisturbed = await asyncio.gather(*(stream_one(client, i, p, out) for i, p in enumerate(prompts)))
        progress = [0] * len(prompts)
        streams = [asyncio.create_task(stream_one(client, i, p, out, progress)) for i, p in enumerate(prompts)]
        while min(progress) < max(1, int(out * SIGNAL_AT)) and not any(s.done() for s in streams):
            await asyncio.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        sig = time.perf_counter()
        probes = asyncio.create_task(probe(server.url, streams))
        drained = await asyncio.gather(*streams)
        done = time.perf_counter()
        refusals, health = await probes
    status = await asyncio.to_thread(server.proc.wait, args.drain_timeout + 60)
    timings = {"signal": sig, "streams_done": done, "exit": time.perf_counter(), "exit_status": status}
    return report(args, undisturbed, drained, timings, refusals, health)


async def probe(url: str, streams: list[asyncio.Task]) -> tuple[list[str], str | None]:
    """While a stream runs: a new request every PROBE_EVERY_S, each on a connection of its own (as
    a client's retry), and /health once. Returns each request's outcome ("503 Retry-After: 1", "200",
    an error) and /health's ("503 draining")."""
    outcomes, health = [], None
    limits = httpx.Limits(max_keepalive_connections=0)
    body = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    async with httpx.AsyncClient(base_url=url, timeout=10, limits=limits, trust_env=False) as client:
        while not all(s.done() for s in streams):
            try:
                if health is None:
                    h = await client.get("/health")
                    health = f"{h.status_code} {h.json().get('status')}"
                r = await client.post("/generate", json=body)
                retry = r.headers.get("retry-after")
                outcomes.append(f"{r.status_code}" + (f" Retry-After: {retry}" if retry else ""))
            except (httpx.HTTPError, ValueError) as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(PROBE_EVERY_S)
    return outcomes, health


def report(args, undisturbed, drained, timings, refusals, health) -> dict:
    """`undisturbed`, `drained`: streams.Result per stream of either round; `timings`: when the
    signal went, the streams ended and the server exited (and its status); `refusals`: what the
    new requests during the drain got; `health`: what /health answered then."""
    sig = timings["signal"]
    refused = [o for o in refusals if o.startswith("503 Retry-After")]
    return {
        "scenario": "drain",
        "deployment": args.deployment,
        "drain_timeout_s": args.drain_timeout,
        "concurrency": args.concurrency,
        "output_len": args.output_len,
        **stream_figures(drained, sig, "signal"),
        "greedy_outputs_consistent": consistent(undisturbed + drained),
        "undisturbed_failures": failures(undisturbed)[:10],
        "new_requests_during_drain": len(refusals),
        "new_requests_refused_503": len(refused),
        "new_requests_otherwise": [o for o in refusals if o not in refused][:10],
        "health_during_drain": health,
        "streams_done_after_signal_s": round(timings["streams_done"] - sig, 3),
        "exit_after_signal_s": round(timings["exit"] - sig, 3),
        "exit_status": timings["exit_status"],
    }


def format_report(r: dict) -> str:
    other = r["new_requests_otherwise"]
    return "\n".join(
        [
            f"deployment: {r['deployment']} --drain-timeout {r['drain_timeout_s']:g} "
            f"({r['concurrency']} streams of {r['output_len']} tokens; SIGTERM once each had a quarter)",
            *format_streams(r, "signal", "SIGTERM"),
            f"new requests during the drain: {r['new_requests_during_drain']}, 503 with Retry-After: "
            f"{r['new_requests_refused_503']}" + (f", otherwise: {other}" if other else ""),
            f"/health during the drain: {r['health_during_drain']}",
            f"streams done {r['streams_done_after_signal_s']:.2f} s after SIGTERM; the server exited after "
            f"{r['exit_after_signal_s']:.2f} s with status {r['exit_status']}",
        ]
    )


def passed(args, r: dict) -> bool:
    """Every stream complete with its undisturbed tokens, every new request refused with 503, exit 0."""
    refusals_ok = r["new_requests_during_drain"] > 0 and not r["new_requests_otherwise"]
    streams_ok = r["requests_failed"] == 0 and not r["undisturbed_failures"] and r["greedy_outputs_consistent"]
    return streams_ok and refusals_ok and r["exit_status"] == 0
