"""End-to-end test of benchmarks/bench_serving.py against a real `afd serve` subprocess.

One server (the tiny DeepSeek-V3, served as "tiny") is shared by the module; the script runs as a
subprocess, exactly as a user would run it. Timings are not checked, only that they are there and
that the counts are exact (ignore_eos makes every request generate exactly --random-output-len).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import Server

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_serving.py"
QUICK = ["--num-prompts", "8", "--random-input-len", "8", "--random-output-len", "4", "--disable-tqdm"]


@pytest.fixture(scope="module")
def server(tiny_v3):
    srv = Server(tiny_v3)
    yield srv
    srv.stop()


def run_bench(server: Server, tmp_path: Path, *extra: str) -> dict:
    """Runs the script; returns its (single) JSONL record after checking the exit code and table."""
    out = tmp_path / "tmp.jsonl"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--base-url", server.url, *QUICK, "--output-file", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    for name in (
        "Successful requests",
        "Benchmark duration (s)",
        "Total generated tokens",
        "Request throughput (req/s)",
        "Output token throughput (tok/s)",
        "Mean TTFT (ms)",
        "P99 ITL (ms)",
        "Median TPOT (ms)",
        "Mean E2E Latency (ms)",
    ):
        assert name in proc.stdout, name
    lines = out.read_text().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def check_quick_record(rec: dict) -> None:
    assert rec["completed"] == 8 and rec["failed"] == 0 and rec["errors"] == []
    assert rec["total_output_tokens"] == 32  # 8 requests x 4 tokens, exactly (ignore_eos)
    assert rec["total_input_tokens"] > 0 and not rec["input_tokens_estimated"]
    assert rec["duration"] > 0 and rec["request_throughput"] > 0 and rec["output_throughput"] > 0
    assert math.isclose(rec["output_throughput"], 32 / rec["duration"])
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2e_latency_ms"):
        assert rec[key] > 0, key
    assert rec["mean_e2e_latency_ms"] >= rec["mean_ttft_ms"]
    assert rec["settings"]["model"] == "tiny"


@pytest.mark.parametrize("backend", ["chat", "completions", "native"])
def test_backend_quick(server, tmp_path, backend):
    rec = run_bench(server, tmp_path, "--backend", backend)
    check_quick_record(rec)
    assert rec["settings"]["backend"] == backend
    assert rec["goodput"] is None  # no SLO given
    if backend != "chat":  # random-ids: the prompt is exactly 8 token ids
        assert rec["total_input_tokens"] == 64


def test_rate_concurrency_goodput(server, tmp_path):
    rec = run_bench(
        server,
        tmp_path,
        "--request-rate",
        "20",
        "--max-concurrency",
        "2",
        "--slo-tpot-ms",
        "10000",
        "--slo-ttft-ms",
        "10000",
    )
    check_quick_record(rec)
    assert rec["settings"]["request_rate"] == 20 and rec["settings"]["max_concurrency"] == 2
    assert rec["goodput"] == pytest.approx(rec["request_throughput"])
    assert rec["concurrency"] <= 2 + 1e-6  # never more than 2 in flight


# -- pure helpers (no server) -------------------------------------------------------------------


def _module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_lengths_and_arrivals():
    b = _module()
    args = b.parse_args(["--num-prompts", "50", "--random-input-len", "10", "--random-range-ratio", "0.5"])
    reqs = b.make_requests(args)
    assert len(reqs) == 50 and all(5 <= len(r.prompt) <= 10 for r in reqs)
    assert all(min(r.prompt) >= b.NUM_SPECIAL_IDS for r in reqs)
    assert b.arrival_delays(3, math.inf, 0) == [0.0, 0.0, 0.0]
    gaps = b.arrival_delays(2000, 100.0, 0)
    assert 0.008 < sum(gaps) / len(gaps) < 0.012  # mean gap 1/rate


def test_slo():
    b = _module()
    r = b.Result(success=True, ttft=0.1, latency=0.5, output_tokens=5)  # TPOT = 100 ms
    assert b.meets_slo(r, 100.0, 100.0) and not b.meets_slo(r, 99.0, None) and not b.meets_slo(r, None, 99.0)
    assert not b.meets_slo(b.Result(success=False), None, None)
