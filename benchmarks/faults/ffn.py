"""Scenario `ffn`: an FFN node dies under steady load, and a replacement joins.

A deployment of roles on this machine (`afd launch --role attention` and one `--role ffn` per FFN
node, meeting at a rendezvous on a free local port, each role a process group of its own, with
--enable-ffn-fault-tolerance). After --before-s the FFN role of node --victim-node gets SIGKILL (the
launcher and its ranks: the machine is gone); --rejoin-after-s later the same command starts a
replacement, which the deployment admits; the load goes on until --after-s after the kill, and
until 3 s after the replacement serves (the deployment switches to it at a step: an idle one would
not), for at most 120 s more.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from afd_engine.processes.rendezvous import free_port
from benchmarks.bench_soak import kv_after_drain
from benchmarks.faults.streams import (
    format_streams,
    gaps,
    http_client,
    make_prompts,
    metric,
    rate,
    stream_client,
    stream_figures,
)
from benchmarks.lib.server import Server, ServerNotReady, afd_command, spawn, stop_process

DEPLOYMENT = (
    "--mode afd --dp-size 1 --ffn-nodes 2 --ffn-ranks-per-node 1 --ep-num-redundant-experts 16 --comm-timeout 5"
)
DEFAULTS = {"deployment": DEPLOYMENT}
# A deployment switches to a staged replacement at its next step, so the load waits for it: it goes
# on until REJOINED_S after the replacement serves, at most WAIT_FOR_REPLACEMENT_S past --after-s.
REJOINED_S = 3.0
WAIT_FOR_REPLACEMENT_S = 120.0
QUICK = {"before_s": 4.0, "after_s": 14.0, "rejoin_after_s": 2.0, "concurrency": 4, "output_len": 32}


class Roles:
    """The deployment's role processes on this machine (each a process group, output to a log):
    FFN roles, then the attention role serving HTTP on a free port."""

    def __init__(self, args, logdir: str) -> None:
        self.args, self.logdir = args, logdir
        rdv = f"127.0.0.1:{free_port('127.0.0.1')}"
        self.common = ["--dist-init-addr", rdv, "--num-threads", "1", *args.deployment.split()]
        self.common += ["--enable-ffn-fault-tolerance"] + (["--model-path", args.model_path] if args.model_path else [])
        self.ffn: list[subprocess.Popen] = []
        self.attention: Server | None = None
        self.nodes = int(_flag(self.common, "--ffn-nodes", 1))
        self.ranks = self.nodes * int(_flag(self.common, "--ffn-ranks-per-node", 1))

    def log(self, *role: str) -> Path:
        started = len(self.ffn) + (self.attention is not None)
        return Path(self.logdir) / f"{'-'.join(role).replace('--', '')}-{started}.log"

    def start_ffn(self, node: int) -> subprocess.Popen:
        role = ("--role", "ffn", "--node-rank", str(node))
        with open(self.log(*role), "w") as log:  # the process keeps its own copy of the descriptor
            proc = spawn(afd_command("launch", *role, *self.common), stdout=log, new_session=True)
        self.ffn.append(proc)
        return proc

    def up(self) -> dict[int, subprocess.Popen]:
        nodes = {n: self.start_ffn(n) for n in range(self.nodes)}

        def attention(port: int) -> list[str]:
            return afd_command("launch", "--role", "attention", "--port", str(port), *self.common)

        try:
            self.attention = Server(attention, log_path=self.log("--role", "attention"))
        except ServerNotReady as exc:
            raise RuntimeError(f"{exc}\nlogs in {self.logdir}") from None
        return nodes

    def stop(self) -> None:
        if self.attention is not None:  # the attention role first: the FFN roles are told and end
            self.attention.stop()
        for proc in reversed(self.ffn):
            stop_process(proc, group=True)


def _flag(argv: list[str], name: str, default):
    return argv[argv.index(name) + 1] if name in argv else default


def run(args, logdir: str) -> dict:
    roles = Roles(args, logdir)
    try:
        return asyncio.run(_run(args, roles))
    finally:
        roles.stop()


async def _run(args, roles: Roles) -> dict:
    nodes = roles.up()
    prompts = make_prompts(args.prompts)
    async with http_client(roles.attention.url) as client:
        results: list = []
        t0 = time.perf_counter()
        deadline = t0 + args.before_s + args.after_s
        events: dict[str, float] = {}

        def until() -> float:
            if args.rejoin_after_s < 0:
                return deadline
            if "full" in events:
                return max(deadline, events["full"] + REJOINED_S)
            return deadline + WAIT_FOR_REPLACEMENT_S

        clients = [stream_client(client, prompts, c, until, args.output_len, results) for c in range(args.concurrency)]

        async def faults():
            await asyncio.sleep(args.before_s)
            os.killpg(nodes[args.victim_node].pid, signal.SIGKILL)  # the launcher and its ranks
            events["kill"] = time.perf_counter()
            while (await metric(client, "afd_ffn_recoveries_total") or 0) < 1:
                await asyncio.sleep(0.05)
            events["recovered"] = time.perf_counter()
            if args.rejoin_after_s < 0:
                return
            await asyncio.sleep(max(0.0, events["kill"] + args.rejoin_after_s - time.perf_counter()))
            roles.start_ffn(args.victim_node)
            events["replacement"] = time.perf_counter()
            while (await metric(client, "afd_ffn_ranks_alive") or 0) < roles.ranks:
                await asyncio.sleep(0.1)
            events["full"] = time.perf_counter()

        watcher = asyncio.create_task(faults())
        await asyncio.gather(*clients)
        end = until()
        watcher.cancel()  # a replacement not serving by now is reported so (time_to_full_size_s None)
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        gauges, _ = await kv_after_drain(client, 30)
        alive = await metric(client, "afd_ffn_ranks_alive")
        read = await metric(client, "afd_ffn_recovery_experts_read_total")
        healthy = (await client.get("/health")).status_code == 200
    return report(args, results, t0, end, events, gauges, alive, read, healthy)


def report(args, results, t0, end, events, gauges, alive, read, healthy) -> dict:
    """`results`: streams.Result per request; `events`: when the kill, the recovery (seen), the
    replacement's start and the return to full size happened."""
    kill, seen = events["kill"], events.get("recovered")
    recovered = end if seen is None else seen
    full = events.get("full", end)
    away = [g for g, a in gaps(results) if not (kill - 1.0 <= a <= recovered + 1.0)]
    held = gauges.get("afd_kv_pages_used", 0.0) - gauges.get("afd_prefix_cache_pages", 0.0)
    return {
        "scenario": "ffn",
        "deployment": args.deployment,
        "victim_ffn_node": args.victim_node,
        "concurrency": args.concurrency,
        "output_len": args.output_len,
        **stream_figures(results, kill, "kill"),
        "longest_gap_away_from_the_kill_s": round(max(away, default=0.0), 3),
        "recovery_seen_after_kill_s": round(seen - kill, 3) if seen is not None else None,
        "throughput_tok_s": {
            "before": rate(results, t0 + min(2.0, args.before_s / 2), kill),
            "during_recovery": rate(results, kill, recovered),
            "degraded": rate(results, recovered, full),
            "rejoined": rate(results, full, end),
        },
        "time_to_full_size_s": round(full - events["replacement"], 3) if "full" in events else None,
        "ffn_ranks_alive_at_end": alive,
        "experts_read_from_checkpoint": read,
        "kv_pages_held_after_drain": held,
        "healthy_at_end": healthy,
    }


def format_report(r: dict) -> str:
    t = r["throughput_tok_s"]
    full, seen = r["time_to_full_size_s"], r["recovery_seen_after_kill_s"]
    return "\n".join(
        [
            f"deployment: {r['deployment']} (FFN node {r['victim_ffn_node']} killed)",
            *format_streams(r, "kill", "the kill"),
            f"longest gap away from the kill: {r['longest_gap_away_from_the_kill_s']:.2f} s",
            "recovery reported " + (f"{seen:.2f} s after the kill" if seen is not None else ": never"),
            f"tokens/s: before {t['before']}, during the recovery {t['during_recovery']}, degraded {t['degraded']}, "
            f"rejoined {t['rejoined']}",
            "time to full size after the replacement started: " + (f"{full:.2f} s" if full is not None else "-"),
            f"FFN ranks alive at the end: {r['ffn_ranks_alive_at_end']:g}; experts read from the checkpoint: "
            f"{r['experts_read_from_checkpoint']:g}",
            f"KV pages held after the drain: {r['kv_pages_held_after_drain']:g}; healthy: {r['healthy_at_end']}",
        ]
    )


def passed(args, r: dict) -> bool:
    """No failed request, the same tokens per prompt, the recovery seen, and the replacement serving
    (if one started)."""
    ok = r["requests_failed"] == 0 and r["greedy_outputs_consistent"] and r["recovery_seen_after_kill_s"] is not None
    return ok and (args.rejoin_after_s < 0 or r["time_to_full_size_s"] is not None)
