"""Scenario `pd`: a decode instance dies under steady load behind `afd router`.

One prefill and two decode instances (`afd serve --disaggregation-mode ...`, each a process group
of its own with its engine) and `afd router` before them. After --before-s decode instance
--victim-decode gets SIGKILL, its engine too; the router resumes each of its streams on the other
decode instance, through the prefill instance, from the tokens the client has; the load goes on
until --after-s after the kill.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from afd_engine.processes.rendezvous import free_port
from benchmarks.bench_soak import kv_after_drain
from benchmarks.faults.streams import (
    format_streams,
    http_client,
    make_prompts,
    metric,
    rate,
    stream_client,
    stream_figures,
)
from benchmarks.lib.server import HOST, Server, afd_server

DEPLOYMENT = "--mode single"
DEFAULTS = {"deployment": DEPLOYMENT}
QUICK = {"before_s": 4.0, "after_s": 12.0, "concurrency": 4, "output_len": 32}


def start_instances(args, logdir: str) -> list[Server]:
    """[prefill, decode 0, decode 1], started side by side; all stopped if one fails."""
    common = [*args.deployment.split(), "--num-threads", "1"]
    common += ["--model-path", args.model_path] if args.model_path else []
    roles = [["prefill", "--disaggregation-bootstrap-port", str(free_port(HOST))], ["decode"], ["decode"]]

    def start(i: int) -> Server:
        flags = ["--disaggregation-mode", *roles[i], *common]
        return afd_server("serve", *flags, log_path=Path(logdir) / f"{roles[i][0]}-{i}.log")

    with ThreadPoolExecutor(len(roles)) as pool:
        futures = [pool.submit(start, i) for i in range(len(roles))]
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < len(roles):
        for server in started:
            server.stop()
        error = next(f.exception() for f in futures if f.exception() is not None)
        raise RuntimeError(f"{error}\nlogs in {logdir}") from None
    return started


def run(args, logdir: str) -> dict:
    servers = start_instances(args, logdir)
    try:
        prefill, *decode = servers
        flags = ["--prefill", prefill.url, *(f for d in decode for f in ("--decode", d.url))]
        servers.append(afd_server("router", *flags, log_path=Path(logdir) / "router.log"))
        return asyncio.run(_run(args, servers[-1], prefill, decode))
    finally:
        for server in reversed(servers):  # the router first
            server.stop()


async def _run(args, router: Server, prefill: Server, decode: list[Server]) -> dict:
    victim, survivor = decode[args.victim_decode], decode[1 - args.victim_decode]
    up = f'afd_router_instance_up{{instance="{victim.url}"}}'
    prompts = make_prompts(args.prompts)
    async with http_client(router.url) as client:
        results: list = []
        t0 = time.perf_counter()
        deadline = t0 + args.before_s + args.after_s
        events: dict[str, float] = {}
        clients = [
            stream_client(client, prompts, c, lambda: deadline, args.output_len, results)
            for c in range(args.concurrency)
        ]

        async def fault():
            await asyncio.sleep(args.before_s)
            os.killpg(victim.pid, signal.SIGKILL)  # the instance and its engine: a lost machine
            events["kill"] = time.perf_counter()
            while await metric(client, up) != 0:
                await asyncio.sleep(0.05)
            events["lost"] = time.perf_counter()

        watcher = asyncio.create_task(fault())
        await asyncio.gather(*clients)
        await asyncio.wait_for(watcher, 60)
        held = {}
        for name, server in (("prefill", prefill), ("decode", survivor)):
            async with http_client(server.url) as instance:
                gauges, _ = await kv_after_drain(instance, 30)
                held[name] = gauges.get("afd_kv_pages_used", 0.0) - gauges.get("afd_prefix_cache_pages", 0.0)
                held[name] += await metric(instance, "afd_kv_pages_reserved") or 0.0
        after = {  # (a counter of a label value appears once it counts)
            "resume": await metric(client, 'afd_router_failovers_total{kind="resume"}') or 0.0,
            "resend": await metric(client, 'afd_router_failovers_total{kind="resend"}') or 0.0,
            "healthy": (await client.get("/health")).status_code == 200,
            "held": held,
        }
    return report(args, results, t0, deadline, events, after)


def report(args, results, t0, end, events, after) -> dict:
    """`results`: streams.Result per request; `events`: when the kill and the router's loss of the
    instance happened; `after`: the router's failovers and health, pages the survivors hold."""
    kill = events["kill"]
    lost = events.get("lost")
    return {
        "scenario": "pd",
        "deployment": f"1 prefill + 2 decode instances ({args.deployment}) behind afd router",
        "victim_decode_instance": args.victim_decode,
        "concurrency": args.concurrency,
        "output_len": args.output_len,
        **stream_figures(results, kill, "kill"),
        "loss_seen_after_kill_s": round(lost - kill, 3) if lost is not None else None,
        "throughput_tok_s": {
            "before": rate(results, t0 + min(2.0, args.before_s / 2), kill),
            "after": rate(results, kill, end),
        },
        "router_failovers": {"resume": after["resume"], "resend": after["resend"]},
        "kv_pages_held_after_drain": after["held"],
        "healthy_at_end": after["healthy"],
    }


def format_report(r: dict) -> str:
    t, f, held = r["throughput_tok_s"], r["router_failovers"], r["kv_pages_held_after_drain"]
    lost = r["loss_seen_after_kill_s"]
    return "\n".join(
        [
            f"deployment: {r['deployment']} (decode instance {r['victim_decode_instance']} killed)",
            *format_streams(r, "kill", "the kill"),
            "the router marked it lost " + (f"{lost:.2f} s after the kill" if lost is not None else ": never"),
            f"tokens/s: before {t['before']}, after the kill {t['after']}",
            f"router failovers: resumed {_g(f['resume'])}, sent again {_g(f['resend'])}",
            f"KV pages held after the drain: prefill {held['prefill']:g}, surviving decode {held['decode']:g}; "
            f"router healthy: {r['healthy_at_end']}",
        ]
    )


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def passed(args, r: dict) -> bool:
    """No failed request, the same tokens per prompt, and the router serving on."""
    return r["requests_failed"] == 0 and r["greedy_outputs_consistent"] and r["healthy_at_end"]
