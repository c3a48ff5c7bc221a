#!/usr/bin/env python3
"""An FFN rank dies under steady load: what do the streams see?

Starts ``afd serve`` with ``--enable-ffn-fault-tolerance`` (a process group of its own, a free
port, the embedded tiny model unless ``--model-path``; the deployment of ``--deployment``), runs
``--concurrency`` clients that stream greedy requests from a fixed set of prompts back to back
(native ``/generate``, ``ignore_eos``), kills (SIGKILL) one FFN rank after ``--before-s`` seconds
and goes on for ``--after-s`` seconds. It reports:

  * the longest gap between two tokens of any stream, and the longest gap of any stream away from
    the kill (the steady state's own hiccups, for scale);
  * requests failed (target 0): a non-200 answer, an error event, or a stream that ended short;
  * output tokens per second before the kill, during the recovery (from the kill until
    ``afd_ffn_recoveries_total`` reads 1 on /metrics) and after it;
  * whether every request of a prompt produced the same tokens (greedy: it must);
  * ``afd_ffn_ranks_alive`` and ``afd_ffn_recovery_experts_read`` after the recovery, and KV pages
    still held once the load stops (0: nothing leaked).

A replacement rank does not rejoin a deployment yet, so ``time_to_full_size_s`` is reported as
null with the reason.

    python benchmarks/bench_faults.py --json faults.json
    python benchmarks/bench_faults.py --quick            # about 25 seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from afd_engine.distributed.rendezvous import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import sse_data  # noqa: E402
from bench_soak import kv_after_drain, process_tree, serve, stop_server  # noqa: E402

DEPLOYMENT = (
    "--mode afd --dp-size 1 --ffn-nodes 1 --ffn-ranks-per-node 2 --ep-num-redundant-experts 16 --comm-timeout 5"
)


def start_server(args, port: int, log):
    flags = args.deployment.split() + ["--enable-ffn-fault-tolerance"]
    return serve(flags + (["--model-path", args.model_path] if args.model_path else []), port, log)


def ffn_rank_pid(root: int, rank: int, ranks_per_node: int) -> int:
    title = f"afd::ffn-{rank // ranks_per_node}-{rank % ranks_per_node}"
    pids = [pid for pid in process_tree(root) if _cmdline(pid) == title]
    if len(pids) != 1:
        raise RuntimeError(f"found {len(pids)} processes named {title} under the server")
    return pids[0]


def _cmdline(pid: int) -> str:
    """What `ps` shows for the process: a rank's title (afd_engine/proctitle.py)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


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


async def watch_recovery(client, kill_at: list, done: dict) -> None:
    """Polls /metrics after the kill until the deployment reports its recovery."""
    while not kill_at:
        await asyncio.sleep(0.05)
    while True:
        try:
            if (await metric(client, "afd_ffn_recoveries_total") or 0) >= 1:
                done["at"] = time.perf_counter()
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.05)


async def run(args, port: int, server_pid: int) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    base = f"http://127.0.0.1:{port}"
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 400) for _ in range(rng.randrange(4, 24))] for _ in range(args.prompts)]
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300), limits=limits, trust_env=False) as client:
        results: list = []
        t0 = time.perf_counter()
        deadline = t0 + args.before_s + args.after_s
        kill_at: list[float] = []
        recovered: dict = {}
        watcher = asyncio.create_task(watch_recovery(client, kill_at, recovered))
        clients = [stream_client(client, prompts, c, deadline, args, results) for c in range(args.concurrency)]

        async def killer():
            await asyncio.sleep(args.before_s)
            pid = ffn_rank_pid(server_pid, args.victim, args.ranks_per_node)
            os.kill(pid, signal.SIGKILL)
            kill_at.append(time.perf_counter())

        await asyncio.gather(killer(), *clients)
        await asyncio.wait_for(watcher, 60)
        gauges, _ = await kv_after_drain(client, 30)
        alive = await metric(client, "afd_ffn_ranks_alive")
        read = await metric(client, "afd_ffn_recovery_experts_read_total")
        healthy = (await client.get("/health")).status_code == 200
    return report(args, results, t0, deadline, kill_at[0], recovered["at"], gauges, alive, read, healthy)


def report(args, results, t0, end, kill, recovered, gauges, alive, read, healthy) -> dict:
    tokens = sorted(t for _, _, times, _, _ in results for t in times)
    gaps = [(b - a, a) for _, _, times, _, _ in results for a, b in zip(times, times[1:])]
    # also the wait from a request's start to its first token: a request that starts in the pause waits there
    gaps += [(times[0] - start, start) for _, start, times, _, _ in results if times]
    longest, at = max(gaps) if gaps else (0.0, t0)
    away = [g for g, a in gaps if not (kill - 1.0 <= a <= recovered + 1.0)]

    def rate(a: float, b: float) -> float:
        return sum(1 for t in tokens if a <= t < b) / (b - a) if b > a else 0.0

    outputs: dict[int, set] = {}
    for i, _, _, ids, error in results:
        if error is None:
            outputs.setdefault(i, set()).add(tuple(ids))
    failed = [error for *_, error in results if error is not None]
    held = gauges.get("afd_kv_pages_used", 0.0) - gauges.get("afd_prefix_cache_pages", 0.0)
    return {
        "deployment": args.deployment,
        "victim_ffn_rank": args.victim,
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
            "before": round(rate(t0 + min(2.0, args.before_s / 2), kill), 1),
            "during": round(rate(kill, recovered), 1),
            "after": round(rate(recovered, end), 1),
        },
        "greedy_outputs_consistent": all(len(v) == 1 for v in outputs.values()),
        "ffn_ranks_alive_after": alive,
        "experts_read_from_checkpoint": read,
        "kv_pages_held_after_drain": held,
        "healthy_after": healthy,
        "time_to_full_size_s": None,
        "time_to_full_size_note": "a replacement FFN rank does not rejoin a running deployment yet",
    }


def format_report(r: dict) -> str:
    t = r["throughput_tok_s"]
    return "\n".join(
        [
            f"deployment: {r['deployment']} (FFN rank {r['victim_ffn_rank']} killed)",
            f"requests: {r['requests']}, failed: {r['requests_failed']}",
            f"longest gap between tokens: {r['longest_token_gap_s']:.2f} s "
            f"(starts {r['longest_gap_starts_after_kill_s']:+.2f} s from the kill; "
            f"away from the kill: {r['longest_gap_away_from_the_kill_s']:.2f} s)",
            f"recovery reported {r['recovery_seen_after_kill_s']:.2f} s after the kill",
            f"tokens/s before {t['before']}, during {t['during']}, after {t['after']}",
            f"greedy outputs consistent: {r['greedy_outputs_consistent']}; FFN ranks alive after: "
            f"{r['ffn_ranks_alive_after']:g}; experts read from the checkpoint: {r['experts_read_from_checkpoint']:g}",
            f"KV pages held after the drain: {r['kv_pages_held_after_drain']:g}; healthy: {r['healthy_after']}",
            f"time to full size: {r['time_to_full_size_s']} ({r['time_to_full_size_note']})",
        ]
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="checkpoint (default: the embedded tiny model)")
    p.add_argument("--deployment", default=DEPLOYMENT, help="afd serve flags of the deployment")
    p.add_argument("--ranks-per-node", type=int, default=2, help="its --ffn-ranks-per-node (to name the victim)")
    p.add_argument("--victim", type=int, default=1, help="the FFN rank killed")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts", type=int, default=6, help="distinct prompts the requests draw from")
    p.add_argument("--before-s", type=float, default=20.0, help="seconds of load before the kill")
    p.add_argument("--after-s", type=float, default=40.0, help="seconds of load after it")
    p.add_argument("--quick", action="store_true", help="a short run: 6 s before, 10 s after, concurrency 4")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    if args.quick:
        args.before_s, args.after_s, args.concurrency, args.output_len = 6.0, 10.0, 4, 32
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    port = free_port("127.0.0.1")
    with tempfile.NamedTemporaryFile("w+", prefix="afd-faults-", suffix=".log", delete=False) as log:
        proc = start_server(args, port, log)
        try:
            r = asyncio.run(run(args, port, proc.pid))
        finally:
            stop_server(proc)
    r["server_log"] = log.name
    print(format_report(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")
    return 0 if r["requests_failed"] == 0 and r["greedy_outputs_consistent"] else 1


if __name__ == "__main__":
    sys.exit(main())
