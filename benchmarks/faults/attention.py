"""Scenario `attention`: an attention rank dies under steady load (--enable-fault-tolerance).

`afd serve` of an AFD deployment with two attention ranks (one process tree); after --before-s the
process of attention rank --victim-rank gets SIGKILL. The survivors and the FFN ranks go on without
it, and the front end resumes each of its requests on a survivor from the tokens streamed so far;
the load goes on until --after-s after the kill. Where the deployment starts a replacement of the
lost rank, the time until it serves (`afd_attention_ranks_alive` back to its count) is reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

from benchmarks.bench_soak import kv_after_drain
from benchmarks.faults.procs import titled
from benchmarks.faults.streams import (
    format_streams,
    http_client,
    make_prompts,
    metric,
    rate,
    stream_client,
    stream_figures,
)
from benchmarks.lib.server import ServerNotReady, afd_server

DEPLOYMENT = "--mode afd --dp-size 2 --ffn-nodes 2 --ffn-ranks-per-node 2 --micro-batches 3"
DEFAULTS = {"deployment": DEPLOYMENT}
QUICK = {"before_s": 4.0, "after_s": 12.0, "concurrency": 4, "output_len": 32}


def server_flags(args) -> list[str]:
    """`afd serve`'s arguments (--port aside): the deployment, one thread per rank, the model."""
    return [*args.deployment.split(), "--num-threads", "1"] + (
        ["--model-path", args.model_path] if args.model_path else []
    )


def run(args, logdir: str) -> dict:
    try:
        server = afd_server(
            "serve", *server_flags(args), "--enable-fault-tolerance", log_path=Path(logdir) / "serve.log"
        )
    except ServerNotReady as exc:
        raise RuntimeError(f"{exc}\nlogs in {logdir}") from None
    try:
        victim = titled(server.pid, f"afd::attention-{args.victim_rank}")
        return asyncio.run(_run(args, server.url, victim))
    finally:
        server.stop()


async def _run(args, url: str, victim: int) -> dict:
    prompts = make_prompts(args.prompts)
    async with http_client(url) as client:
        ranks = await metric(client, "afd_attention_ranks_alive") or 0.0
        results: list = []
        t0 = time.perf_counter()
        deadline = t0 + args.before_s + args.after_s
        events: dict[str, float] = {}
        clients = [
            stream_client(client, prompts, c, lambda: deadline, args.output_len, results)
            for c in range(args.concurrency)
        ]

        async def alive() -> float:
            return await metric(client, "afd_attention_ranks_alive") or 0.0

        async def fault():
            await asyncio.sleep(args.before_s)
            os.kill(victim, signal.SIGKILL)
            events["kill"] = time.perf_counter()
            while await alive() >= ranks:
                await asyncio.sleep(0.05)
            events["lost"] = time.perf_counter()
            while await alive() < ranks:
                await asyncio.sleep(0.1)
            events["rejoined"] = time.perf_counter()

        watcher = asyncio.create_task(fault())
        await asyncio.gather(*clients)
        watcher.cancel()  # what was not seen by the end of the load is reported as never
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        gauges, _ = await kv_after_drain(client, 30)
        after = {
            "resumed": await metric(client, "afd_requests_resumed_total"),
            "alive": await metric(client, "afd_attention_ranks_alive"),
            "healthy": (await client.get("/health")).status_code == 200,
        }
    return report(args, results, t0, deadline, events, gauges, ranks, after)


def report(args, results, t0, end, events, gauges, ranks, after) -> dict:
    """`results`: streams.Result per request; `events`: when the kill, the loss and the
    replacement's return (on /metrics) happened; `ranks`: attention ranks alive before; `after`:
    resumed, alive and healthy at the end."""
    kill, lost, back = events["kill"], events.get("lost"), events.get("rejoined")
    held = gauges.get("afd_kv_pages_used", 0.0) - gauges.get("afd_prefix_cache_pages", 0.0)
    return {
        "scenario": "attention",
        "deployment": args.deployment,
        "victim_attention_rank": args.victim_rank,
        "concurrency": args.concurrency,
        "output_len": args.output_len,
        **stream_figures(results, kill, "kill"),
        "loss_seen_after_kill_s": round(lost - kill, 3) if lost is not None else None,
        "replacement_serving_after_kill_s": round(back - kill, 3) if back is not None else None,
        "throughput_tok_s": {
            "before": rate(results, t0 + min(2.0, args.before_s / 2), kill),
            "degraded": rate(results, kill, end if back is None else back),
            "rejoined": rate(results, back, end) if back is not None else None,
        },
        "attention_ranks_alive_before": ranks,
        "attention_ranks_alive_at_end": after["alive"],
        "requests_resumed": after["resumed"],
        "kv_pages_held_after_drain": held,
        "healthy_at_end": after["healthy"],
    }


def format_report(r: dict) -> str:
    t = r["throughput_tok_s"]
    lost, back = r["loss_seen_after_kill_s"], r["replacement_serving_after_kill_s"]
    return "\n".join(
        [
            f"deployment: {r['deployment']} --enable-fault-tolerance (attention rank {r['victim_attention_rank']} "
            "killed)",
            *format_streams(r, "kill", "the kill"),
            "loss reported on /metrics " + (f"{lost:.2f} s after the kill" if lost is not None else ": never"),
            "a replacement serving " + (f"{back:.2f} s after the kill" if back is not None else ": none by the end"),
            f"tokens/s: before {t['before']}, degraded {t['degraded']}, rejoined {t['rejoined']}",
            f"requests resumed: {_g(r['requests_resumed'])}; attention ranks alive: "
            f"{_g(r['attention_ranks_alive_before'])} before, {_g(r['attention_ranks_alive_at_end'])} at the end",
            f"KV pages held after the drain: {r['kv_pages_held_after_drain']:g}; healthy: {r['healthy_at_end']}",
        ]
    )


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def passed(args, r: dict) -> bool:
    """No failed request, the same tokens per prompt, and the deployment serving on."""
    return r["requests_failed"] == 0 and r["greedy_outputs_consistent"] and r["healthy_at_end"]
