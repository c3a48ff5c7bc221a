"""bench_comm (benchmarks/kernels): measured volumes equal the analytic ones; two-stage saves what the seed reports."""

from __future__ import annotations

import json
import subprocess
import sys


def run(tmp_path, *args: str) -> list[dict]:
    out = tmp_path / "comm.json"
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels.bench_comm", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "ratio two-stage/direct between nodes" in res.stdout
    return json.loads(out.read_text())["rows"]


def assert_rows_equal_analytic(rows: list[dict]) -> None:
    for row in rows:
        for mode in ("two-stage", "direct"):
            m = row[mode]
            assert m["dispatch_inter_bytes"] == m["dispatch_inter_bytes_analytic"]
            assert m["dispatch_inter_copies"] == m["dispatch_inter_copies_analytic"]
            assert m["combine_inter_bytes"] == m["combine_inter_bytes_analytic"]
            assert m["max_relative_error"] < 0.07  # fp8 dispatch, bf16 combine


def test_quick(tmp_path):
    assert_rows_equal_analytic(run(tmp_path, "--quick"))


def test_deepseek_v3_routing_32_a_ranks_2_nodes_of_8(tmp_path):
    rows = run(tmp_path, "--a-ranks", "32", "--ffn-nodes", "2", "--ffn-ranks-per-node", "8", "--tokens", "64")
    assert_rows_equal_analytic(rows)
    assert rows[0]["direct"]["dispatch_inter_copies"] == 32 * 64 * 8
    assert rows[0]["dispatch_ratio"] <= 1 / 3.9
