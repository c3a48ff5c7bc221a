#!/usr/bin/env python
"""Prefill-decode disaggregation against two plain replicas, on the same machine, taking turns.

The workload: `--streams` short requests decode continuously (each a prompt of --short-len
tokens and --short-out output tokens, followed at once by the next), while long prompts of
--long-len tokens (--long-out output tokens) arrive every --long-every seconds. A long prompt's
prefill lands in the batch of a replica that is decoding short streams, and every stream there
waits for it; a PD decode instance never prefills.

Deployments, each behind `afd router`, each instance an `afd serve` process with --num-threads
--threads, pinned to a core of its own (as on separate machines; --no-pin shares them):
  (a) pd-<backend>: one prefill instance + one decode instance, per --backends (builtin,
      mooncake);
  (b) replicas: the same two processes as plain instances (--disaggregation-mode null), the
      router sending each request to the less loaded one;
  (c) pd-<backend>-local: (a) with conditional disaggregation, `afd router
      --local-prefill-max-tokens N`: prompts of at most N tokens (the short ones) go to the decode
      instance alone, which prefills them in its batch; long prompts still go through the
      prefill instance (--local-prefill-max-tokens 0: not run).

The model (--model): dsv3-4k (default), a random-weight checkpoint with DeepSeek-V3's attention
dimensions (MLA, latent 512, as bench_vs_vllm serves) and a 4,096-token context, where a
1,000-token prompt costs about 50 decode steps, as long prompts do on real deployments; or
embedded, the trained default model (512-token context: a 440-token prompt costs about 4 decode
steps, too few for a prefill to stall much); or --model-path.

Reported per deployment: the short streams' TPOT p50/p99 (the gaps between their tokens), TTFT
p50/p99 (short and long requests apart), output tokens/s over the run, and for PD the KV
transfer's MB/s and time per request (from the decode instance's /metrics and timelines).

    python -m benchmarks.bench_pd --json benchmarks/results/pd_<date>.json
    python -m benchmarks.bench_pd --model embedded --long-len 440 --local-prefill-max-tokens 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx

from afd_engine.processes.rendezvous import free_port
from benchmarks.dsv3_checkpoint import BENCH_MODEL_OVERRIDES
from benchmarks.lib.results import write_json
from benchmarks.lib.server import Server, afd_server


class Deployment:
    """Two instances (prefill + decode, or two replicas) and a router, as processes."""

    def __init__(self, ns, kind: str) -> None:
        self.servers: list[Server] = []
        try:
            self._start(ns, kind)
        except BaseException:
            self.stop()
            raise

    def _start(self, ns, kind: str) -> None:
        common = ["--num-threads", str(ns.threads), "--kv-cache-memory-mb", "64", "--served-model-name", "m"]
        common += ["--max-num-batched-tokens", str(ns.chunk)]
        if ns.model_path:
            common += ["--model-path", ns.model_path]
        router_flags = []
        if kind.endswith("-local"):
            kind = kind.removesuffix("-local")
            router_flags = ["--local-prefill-max-tokens", str(ns.local_prefill_max_tokens)]
            router_flags += ["--tokenizer", ns.model_path]
        if kind == "replicas":
            roles = [[], []]
        else:
            pd = ["--disaggregation-transfer-backend", kind.removeprefix("pd-")]
            bootstrap = str(free_port("127.0.0.1"))
            roles = [
                ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", bootstrap, *pd],
                ["--disaggregation-mode", "decode", *pd],
            ]
        # instance i on core i of ours, as on separate machines (its children inherit the mask)
        cores = sorted(os.sched_getaffinity(0))
        for i, role in enumerate(roles):
            pin = [cores[i % len(cores)]] if ns.pin and len(cores) > 1 else None
            self.servers.append(afd_server("serve", *common, *role, cores=pin))
        self.urls = [s.url for s in self.servers]
        if kind == "replicas":
            router = [f"--replica={u}" for u in self.urls]
        else:
            router = [f"--prefill={self.urls[0]}", f"--decode={self.urls[1]}"]
        self.servers.append(afd_server("router", *router, *router_flags))
        self.url = self.servers[-1].url

    def metric(self, url: str, name: str) -> float:
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        for server in reversed(self.servers):  # the router first
            server.stop()


async def one_request(client: httpx.AsyncClient, url: str, ids: list[int], out: int) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": out, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    sent = time.perf_counter()
    stamps, timeline = [], None
    async with client.stream("POST", url + "/generate", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            now = time.perf_counter()
            stamps += [now] * len(event["output_ids"])
            timeline = event["meta_info"].get("timeline", timeline)
    return {
        "ttft": stamps[0] - sent,
        "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
        "tokens": len(stamps),
        "timeline": timeline,
    }


async def workload(ns, url: str, seed: int, duration: float) -> dict:
    rng = random.Random(seed)
    vocab = ns.vocab

    def prompt(n: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(n)]

    short, long_, stop = [], [], time.perf_counter() + duration
    async with httpx.AsyncClient(timeout=httpx.Timeout(300)) as client:

        async def stream_loop():
            while time.perf_counter() < stop:
                short.append(await one_request(client, url, prompt(ns.short_len), ns.short_out))

        async def long_loop():
            tasks = []
            await asyncio.sleep(ns.long_every / 2)
            while time.perf_counter() < stop:
                tasks.append(asyncio.ensure_future(one_request(client, url, prompt(ns.long_len), ns.long_out)))
                await asyncio.sleep(ns.long_every)
            long_.extend(await asyncio.gather(*tasks))

        began = time.perf_counter()
        await asyncio.gather(*(stream_loop() for _ in range(ns.streams)), long_loop())
        elapsed = time.perf_counter() - began
    gaps = [g for r in short for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in short + long_)
    timelines = [r["timeline"] for r in short + long_ if r["timeline"]]
    return {
        "tpot_p50_ms": 1000 * pct(gaps, 50),
        "tpot_p99_ms": 1000 * pct(gaps, 99),
        "ttft_short_p50_ms": 1000 * pct([r["ttft"] for r in short], 50),
        "ttft_short_p99_ms": 1000 * pct([r["ttft"] for r in short], 99),
        "ttft_long_p50_ms": 1000 * pct([r["ttft"] for r in long_], 50),
        "ttft_long_p99_ms": 1000 * pct([r["ttft"] for r in long_], 99),
        "output_tokens_per_s": tokens / elapsed,
        "requests": {"short": len(short), "long": len(long_)},
        "timelines": timelines,
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def transfer_figures(timelines: list[dict]) -> dict:
    sent = [t for t in timelines if t.get("transfer_bytes")]  # (a request prefilled locally has none)
    if not sent:
        return {}
    nbytes = sum(t["transfer_bytes"] for t in sent)
    seconds = sum(t["transfer_s"] for t in sent)
    return {
        "transfer_mb_per_s": nbytes / 2**20 / seconds if seconds else float("nan"),
        "transfer_ms_per_request": 1000 * seconds / len(sent),
        "transfer_kb_per_request": nbytes / 1024 / len(sent),
        "ttft_split_ms_mean": {
            k: 1000 * sum(t[k] for t in sent) / len(sent)
            for k in ("queue_s", "prefill_s", "transfer_s", "kv_wait_s", "first_decode_step_s")
        },
    }


def model_path(name: str, workdir: str) -> str:
    """The checkpoint of --model: the embedded one, or dsv3-4k written into `workdir` once."""
    if name == "embedded":
        from afd_engine.default_model import default_model_path

        return str(default_model_path())
    out = os.path.join(workdir, name)
    if not os.path.isfile(os.path.join(out, "config.json")):
        from afd_engine.tiny_model import make_tiny_model

        overrides = {**BENCH_MODEL_OVERRIDES, "max_position_embeddings": 4096}
        make_tiny_model(out, arch="deepseek_v3", seed=0, overrides=overrides)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dsv3-4k", choices=["dsv3-4k", "embedded"], help="see above")
    parser.add_argument("--model-path", default=None, help="instead: this checkpoint")
    parser.add_argument("--workdir", default="/tmp/afd-bench-pd", help="where the dsv3-4k checkpoint is written")
    parser.add_argument("--threads", type=int, default=1, help="--num-threads of each instance")
    parser.add_argument("--chunk", type=int, default=512, help="--max-num-batched-tokens of each instance")
    parser.add_argument("--streams", type=int, default=8, help="short requests decoding at once")
    parser.add_argument("--short-len", type=int, default=24)
    parser.add_argument("--short-out", type=int, default=64)
    parser.add_argument("--long-len", type=int, default=1000)
    parser.add_argument("--long-out", type=int, default=8)
    parser.add_argument("--long-every", type=float, default=1.0, help="seconds between long prompts")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of measured load per deployment")
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds of load before it, not measured")
    parser.add_argument("--backends", nargs="+", default=["builtin", "mooncake"], choices=["builtin", "mooncake"])
    parser.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=64,
        help="also run pd-<first backend>-local, its router sending prompts of at most this many tokens to the "
        "decode instance alone (0: not run)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="turns of every deployment (results per turn)")
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let the instances share every core (default: instance i on core i, as on separate machines; "
        "the router and the load generator run anywhere)",
    )
    parser.add_argument("--json", default=None, help="write the results here")
    ns = parser.parse_args(argv)
    ns.model_path = ns.model_path or model_path(ns.model, ns.workdir)
    config = json.load(open(os.path.join(ns.model_path, "config.json")))
    ns.vocab = config["vocab_size"]
    if ns.long_len + ns.long_out > config["max_position_embeddings"]:
        parser.error(f"--long-len {ns.long_len} does not fit the model's {config['max_position_embeddings']} positions")
    kinds = ["replicas"] + [f"pd-{b}" for b in ns.backends]
    if ns.local_prefill_max_tokens > 0:
        kinds.append(f"pd-{ns.backends[0]}-local")
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for turn in range(ns.rounds):
        for kind in kinds:
            dep = Deployment(ns, kind)
            try:
                asyncio.run(workload(ns, dep.url, seed=99, duration=ns.warmup))  # same prompts for every deployment
                result = asyncio.run(workload(ns, dep.url, seed=turn, duration=ns.duration))
            finally:
                dep.stop()
            result.update(transfer_figures(result.pop("timelines")))
            runs[kind].append(result)
            print(f"turn {turn} {kind}: " + json.dumps({k: v for k, v in result.items() if k != "ttft_split_ms_mean"}))
    summary = {}
    base = runs["replicas"]
    for kind in kinds[1:]:
        summary[kind] = {
            "tpot_p99_vs_replicas": [r["tpot_p99_ms"] / b["tpot_p99_ms"] for r, b in zip(runs[kind], base)],
            "throughput_vs_replicas": [
                r["output_tokens_per_s"] / b["output_tokens_per_s"] for r, b in zip(runs[kind], base)
            ],
        }
    report = {
        "settings": {k: v for k, v in vars(ns).items() if k != "json"},
        "runs": runs,
        "summary": summary,
    }
    print(json.dumps(summary, indent=1))
    if ns.json:
        write_json(ns.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
