#!/usr/bin/env python3
"""An FFN rank dies under steady load, and a replacement joins: what do the streams see?

Starts a deployment of roles on this machine (``afd launch --role attention`` and one ``--role
ffn`` per FFN node, meeting at a rendezvous on a free local port; each role a process group of
its own; the embedded tiny model unless ``--model-path``; the topology of ``--deployment``, with
``--enable-ffn-fault-tolerance``). ``--concurrency`` clients stream greedy requests from a fixed
set of prompts back to back (native ``/generate``, ``ignore_eos``). After ``--before-s`` seconds
the FFN role of node ``--victim-node`` is killed (SIGKILL to its process group: the machine is
gone); ``--rejoin-after-s`` seconds later the same ``afd launch --role ffn`` command starts a
replacement, which the deployment admits; the load goes on until ``--after-s`` seconds after the
kill. It reports:

  * the longest gap between two tokens of any stream (a request's wait for its first token
    counts), and the longest away from the kill, for scale;
  * requests failed (target 0): a non-200 answer, an error event, or a stream that ended short;
  * output tokens per second before the kill, during the recovery (from the kill until
    ``afd_ffn_recoveries_total`` reads 1), degraded (until the replacement serves) and rejoined;
  * time to full size: from the replacement's start until ``afd_ffn_ranks_alive`` is back;
  * whether every request of a prompt produced the same tokens (greedy: it must);
  * experts the recovery read from the checkpoint, and KV pages still held once the load stops.

    python -m benchmarks.bench_faults --json faults.json
    python -m benchmarks.bench_faults --quick            # about 30 seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from afd_engine.processes.rendezvous import free_port
from benchmarks.bench_serving import sse_data
from benchmarks.bench_soak import kv_after_drain
from benchmarks.lib.results import write_json
from benchmarks.lib.server import Server, ServerNotReady, afd_command, spawn, stop_process

DEPLOYMENT = (
    "--mode afd --dp-size 1 --ffn-nodes 2 --ffn-ranks-per-node 1 --ep-num-redundant-experts 16 --comm-timeout 5"
)


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


async def metric(client: httpx.AsyncClient, name: str) -> float | None:
    for line in (await client.get("/metrics")).text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return float(value)
    return None


async def stream_client(client, prompts, c: int, deadline: float, args, results: list) -> None:
    """Requests back to back until the deadline: (prompt index, start, token times, ids, error)."""
    rng = random.Random(c)
    while time.perf_counter() < deadline:
        i = rng.randrange(len(prompts))
        body = {
            "input_ids": prompts[i],
            "stream": True,
            "sampling_params": {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True},
        }
        start, times, ids, error = time.perf_counter(), [], [], None
        try:
            async with client.stream("POST", "/generate", json=body) as r:
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                else:
                    async for data in sse_data(r):
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            error = f"error event: {chunk['error']}"
                            break
                        new = chunk.get("output_ids") or []
                        now = time.perf_counter()
                        times += [now] * len(new)
                        ids += new
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        if error is None and len(ids) != args.output_len:
            error = f"ended after {len(ids)} of {args.output_len} tokens"
        results.append((i, start, times, ids, error))


async def run(args, roles: Roles) -> dict:
    nodes = roles.up()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    base = roles.attention.url
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 400) for _ in range(rng.randrange(4, 24))] for _ in range(args.prompts)]
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300), limits=limits, trust_env=False) as client:
        results: list = []
        t0 = time.perf_counter()
        deadline = t0 + args.before_s + args.after_s
        events: dict[str, float] = {}
        clients = [stream_client(client, prompts, c, deadline, args, results) for c in range(args.concurrency)]

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
        await asyncio.wait_for(watcher, 120)
        gauges, _ = await kv_after_drain(client, 30)
        alive = await metric(client, "afd_ffn_ranks_alive")
        read = await metric(client, "afd_ffn_recovery_experts_read_total")
        healthy = (await client.get("/health")).status_code == 200
    return report(args, results, t0, deadline, events, gauges, alive, read, healthy)


def report(args, results, t0, end, events, gauges, alive, read, healthy) -> dict:
    """`results`: (prompt, start, token times, ids, error) per request; `events`: when the kill,
    the recovery (seen), the replacement's start and the return to full size happened."""
    kill, recovered = events["kill"], events["recovered"]
    full = events.get("full", end)
    tokens = sorted(t for _, _, times, _, _ in results for t in times)
    gaps = [(b - a, a) for _, _, times, _, _ in results for a, b in zip(times, times[1:])]
    # a request that starts while serving pauses waits for its first token: that counts too
    gaps += [(times[0] - start, start) for _, start, times, _, _ in results if times]
    longest, at = max(gaps) if gaps else (0.0, t0)
    away = [g for g, a in gaps if not (kill - 1.0 <= a <= recovered + 1.0)]

    def rate(a: float, b: float) -> float | None:
        return round(sum(1 for t in tokens if a <= t < b) / (b - a), 1) if b > a else None

    outputs: dict[int, set] = {}
    for i, _, _, ids, error in results:
        if error is None:
            outputs.setdefault(i, set()).add(tuple(ids))
    failed = [error for *_, error in results if error is not None]
    held = gauges.get("afd_kv_pages_used", 0.0) - gauges.get("afd_prefix_cache_pages", 0.0)
    return {
        "deployment": args.deployment,
        "victim_ffn_node": args.victim_node,
        "concurrency": args.concurrency,
        "output_len": args.output_len,
        "requests": len(results),
        "requests_failed": len(failed),
        "failures": failed[:10],
        "longest_token_gap_s": round(longest, 3),
        "longest_gap_starts_after_kill_s": round(at - kill, 3),
        "longest_gap_away_from_the_kill_s": round(max(away, default=0.0), 3),
        "recovery_seen_after_kill_s": round(recovered - kill, 3),
        "throughput_tok_s": {
            "before": rate(t0 + min(2.0, args.before_s / 2), kill),
            "during_recovery": rate(kill, recovered),
            "degraded": rate(recovered, full),
            "rejoined": rate(full, end),
        },
        "time_to_full_size_s": round(full - events["replacement"], 3) if "full" in events else None,
        "greedy_outputs_consistent": all(len(v) == 1 for v in outputs.values()),
        "ffn_ranks_alive_at_end": alive,
        "experts_read_from_checkpoint": read,
        "kv_pages_held_after_drain": held,
        "healthy_at_end": healthy,
    }


def format_report(r: dict) -> str:
    t = r["throughput_tok_s"]
    full = r["time_to_full_size_s"]
    return "\n".join(
        [
            f"deployment: {r['deployment']} (FFN node {r['victim_ffn_node']} killed)",
            f"requests: {r['requests']}, failed: {r['requests_failed']}",
            f"longest gap between tokens: {r['longest_token_gap_s']:.2f} s "
            f"(starts {r['longest_gap_starts_after_kill_s']:+.2f} s from the kill; "
            f"away from the kill: {r['longest_gap_away_from_the_kill_s']:.2f} s)",
            f"recovery reported {r['recovery_seen_after_kill_s']:.2f} s after the kill",
            f"tokens/s: before {t['before']}, during the recovery {t['during_recovery']}, degraded {t['degraded']}, "
            f"rejoined {t['rejoined']}",
            "time to full size after the replacement started: " + (f"{full:.2f} s" if full is not None else "-"),
            f"greedy outputs consistent: {r['greedy_outputs_consistent']}; FFN ranks alive at the end: "
            f"{r['ffn_ranks_alive_at_end']:g}; experts read from the checkpoint: {r['experts_read_from_checkpoint']:g}",
            f"KV pages held after the drain: {r['kv_pages_held_after_drain']:g}; healthy: {r['healthy_at_end']}",
        ]
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="checkpoint (default: the embedded tiny model)")
    p.add_argument("--deployment", default=DEPLOYMENT, help="the topology flags every role gets")
    p.add_argument("--victim-node", type=int, default=1, help="the FFN node whose role is killed")
    p.add_argument(
        "--rejoin-after-s", type=float, default=10.0, help="seconds from the kill to the replacement (<0: none)"
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts", type=int, default=6, help="distinct prompts the requests draw from")
    p.add_argument("--before-s", type=float, default=20.0, help="seconds of load before the kill")
    p.add_argument("--after-s", type=float, default=60.0, help="seconds of load after it")
    p.add_argument("--quick", action="store_true", help="a short run: 4 s before, 14 s after, a replacement at 2 s")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    if args.quick:
        args.before_s, args.after_s, args.rejoin_after_s = 4.0, 14.0, 2.0
        args.concurrency, args.output_len = 4, 32
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logdir = tempfile.mkdtemp(prefix="afd-faults-")
    roles = Roles(args, logdir)
    try:
        r = asyncio.run(run(args, roles))
    finally:
        roles.stop()
    r["logs"] = logdir
    print(format_report(r))
    if args.json:
        write_json(args.json, r)
    ok = r["requests_failed"] == 0 and r["greedy_outputs_consistent"]
    return 0 if ok and (args.rejoin_after_s < 0 or r["time_to_full_size_s"] is not None) else 1


if __name__ == "__main__":
    sys.exit(main())
