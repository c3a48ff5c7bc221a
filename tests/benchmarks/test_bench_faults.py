"""bench_faults: an FFN node killed under streaming load costs no request and no token, a
replacement brings the deployment back to full size, and the report says how long the streams
waited and what the recovery did."""

from __future__ import annotations

import json

import pytest

from tests.process_helpers import bench_run, load_bench


@pytest.mark.timeout(300)
def test_quick_fault_run_loses_nothing_and_returns_to_full_size(tmp_path, tiny_v3):
    out = tmp_path / "faults.json"
    res = bench_run("bench_faults.py", "--quick", "--model-path", tiny_v3, "--json", str(out), timeout=280)
    r = json.loads(out.read_text())
    assert r["requests"] > 0 and r["requests_failed"] == 0, r["failures"]
    assert r["greedy_outputs_consistent"] is True
    # node 1's experts have no copy on node 0 (expert groups stay on their node): read from the checkpoint
    assert r["experts_read_from_checkpoint"] > 0
    assert r["ffn_ranks_alive_at_end"] == 2 and r["time_to_full_size_s"] is not None  # the replacement serves
    assert r["kv_pages_held_after_drain"] == 0 and r["healthy_at_end"] is True
    # the kill is seen by its process exit (the same machine), long before --comm-timeout's 5 s
    assert 0 < r["recovery_seen_after_kill_s"] < 5, r
    assert r["longest_token_gap_s"] < 5, r
    rates = r["throughput_tok_s"]
    assert all(rates[k] > 0 for k in ("before", "degraded", "rejoined")), rates
    assert "failed: 0" in res.stdout


def test_the_report_measures_gaps_failures_and_rates_from_the_streams():
    bench = load_bench("bench_faults.py")
    args = bench.parse_args(["--before-s", "10", "--after-s", "20", "--output-len", "3"])
    # (prompt, start, token times, ids, error); kill at 10, recovery seen at 12, replacement at 14,
    # full size at 16, the load ends at 30
    results = [
        (0, 0.0, [1.0, 2.0, 3.0], [5, 6, 7], None),
        (0, 9.0, [9.5, 12.5, 13.0], [5, 6, 7], None),  # waited 3 s across the kill
        (1, 14.0, [15.0, 15.2, 15.4], [8, 9, 9], None),
        (1, 16.0, [17.0], [8], "ended after 1 of 3 tokens"),
    ]
    events = {"kill": 10.0, "recovered": 12.0, "replacement": 14.0, "full": 16.0}
    gauges = {"afd_kv_pages_used": 4.0, "afd_prefix_cache_pages": 4.0}
    r = bench.report(args, results, 0.0, 30.0, events, gauges, 2.0, 6.0, True)
    assert r["requests"] == 4 and r["requests_failed"] == 1 and r["failures"] == ["ended after 1 of 3 tokens"]
    assert r["longest_token_gap_s"] == 3.0 and r["longest_gap_starts_after_kill_s"] == -0.5
    assert r["longest_gap_away_from_the_kill_s"] == 1.0  # the first token of a request, at t=14 to 15
    # before: from 2 s (a warm-up left out) to the kill, 3 tokens in 8 s; during: none in 2 s;
    # degraded (12-16 s): 5 in 4 s; rejoined (16-30 s): 1 in 14 s
    assert r["throughput_tok_s"] == {"before": 0.4, "during_recovery": 0.0, "degraded": 1.2, "rejoined": 0.1}
    assert r["time_to_full_size_s"] == 2.0
    assert r["greedy_outputs_consistent"] is True and r["kv_pages_held_after_drain"] == 0.0
    del events["full"]
    assert bench.report(args, results, 0.0, 30.0, events, gauges, 1.0, 6.0, True)["time_to_full_size_s"] is None
