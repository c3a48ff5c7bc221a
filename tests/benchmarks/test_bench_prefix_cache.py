"""bench_prefix_cache: every deployment served and measured, figures sane, JSON and table written."""

from __future__ import annotations

import json

import pytest

from tests.process_helpers import bench_run, load_bench

SCRIPT = "bench_prefix_cache.py"
RUNS = ["1 rank, cache on", "1 rank, cache off", "2 ranks, cache_aware", "2 ranks, round_robin"]


def test_quick_run_writes_every_figure(tmp_path, tiny_v3):
    out = tmp_path / "prefix.json"
    res = bench_run(SCRIPT, "--quick", "--model-path", tiny_v3, "--json", str(out))
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert list(runs) == RUNS
    for name, r in runs.items():
        # --quick: 2 groups x 4 requests, 64-token system prompt + 8-token question, 4 tokens out
        assert r["completed"] == 8 and r["failed"] == 0, name
        assert r["total_input_tokens"] == 8 * 72 and r["total_output_tokens"] == 8 * 4, name
        assert r["output_throughput"] > 0 and r["median_ttft_ms"] > 0, name
        assert 0 <= r["cache_hit_rate"] <= 64 / 72, name  # at most the system prompt is shared
        # The server counts what the responses reported, plus the warm-up request (72 tokens, no hit).
        assert r["server"]["afd_prefix_cache_hit_tokens_total"] == r["total_cached_tokens"], name
        assert r["server"]["afd_prefix_cache_queried_tokens_total"] == r["total_input_tokens"] + 72, name
    off, on = runs["1 rank, cache off"], runs["1 rank, cache on"]
    assert off["cache_hit_rate"] == 0 and off["total_cached_tokens"] == 0
    assert on["cache_hit_rate"] > 0 and on["total_cached_tokens"] % 16 == 0  # whole pages
    assert "--disable-radix-cache" in off["server_flags"] and "round_robin" in runs[RUNS[3]]["server_flags"]
    c = data["comparisons"]
    assert c["throughput_on_over_off"] == pytest.approx(on["output_throughput"] / off["output_throughput"])
    assert c["median_ttft_off_over_on"] == pytest.approx(off["median_ttft_ms"] / on["median_ttft_ms"])
    aware, rr = runs[RUNS[2]], runs[RUNS[3]]
    assert c["hit_rate_cache_aware_minus_round_robin"] == pytest.approx(aware["cache_hit_rate"] - rr["cache_hit_rate"])
    assert "| deployment | output tok/s | median TTFT ms | cache hit rate |" in res.stdout
    assert all(f"| {name} |" in res.stdout for name in RUNS)


def _module():
    return load_bench(SCRIPT)


def _run(tok_s: float, ttft_ms: float, hit: float) -> dict:
    return {"output_throughput": tok_s, "median_ttft_ms": ttft_ms, "cache_hit_rate": hit, "completed": 1, "failed": 0}


def test_comparisons_and_targets():
    b = _module()
    runs = {
        b.SINGLE_ON: _run(300.0, 50.0, 0.75),
        b.SINGLE_OFF: _run(200.0, 100.0, 0.0),
        b.DP_AWARE: _run(500.0, 40.0, 0.5),
        b.DP_RR: _run(400.0, 60.0, 0.6),
    }
    c = b.comparisons(runs)
    assert c["throughput_on_over_off"] == 1.5 and c["median_ttft_off_over_on"] == 2.0
    assert c["hit_rate_cache_aware_minus_round_robin"] == pytest.approx(-0.1)
    assert c["throughput_cache_aware_over_round_robin"] == 1.25
    assert not c["target_cache_2x_throughput_or_3x_ttft"] and not c["target_cache_aware_hit_rate_above_round_robin"]
    table = b.markdown(runs, c)
    assert "| 1 rank, cache on | 300.0 | 50.0 | 0.750 | 1 / 0 |" in table
    assert "x1.50" in table and "not met" in table

    runs[b.SINGLE_ON] = _run(300.0, 30.0, 0.75)  # TTFT 3.33x lower: enough on its own
    runs[b.DP_AWARE] = _run(500.0, 40.0, 0.7)
    c = b.comparisons(runs)
    assert c["target_cache_2x_throughput_or_3x_ttft"] and c["target_cache_aware_hit_rate_above_round_robin"]
    assert "not met" not in b.markdown(runs, c)
