"""bench_faults: an FFN rank killed under streaming load costs no request and no token, and the
report says how long the streams waited and what the recovery did."""

from __future__ import annotations

import json

from tests.process_helpers import bench_run, load_bench


def test_quick_fault_run_loses_nothing(tmp_path, tiny_v3):
    out = tmp_path / "faults.json"
    res = bench_run("bench_faults.py", "--quick", "--model-path", tiny_v3, "--json", str(out))
    r = json.loads(out.read_text())
    assert r["requests"] > 0 and r["requests_failed"] == 0, r["failures"]
    assert r["greedy_outputs_consistent"] is True
    assert (r["ffn_ranks_alive_after"], r["experts_read_from_checkpoint"]) == (1, 0)  # the copies took over
    assert r["kv_pages_held_after_drain"] == 0 and r["healthy_after"] is True
    # the kill is seen by its process exit (the same machine), long before --comm-timeout's 5 s
    assert 0 < r["recovery_seen_after_kill_s"] < 5, r
    assert r["longest_token_gap_s"] < 5, r
    assert all(r["throughput_tok_s"][k] > 0 for k in ("before", "after")), r["throughput_tok_s"]
    assert r["time_to_full_size_s"] is None and "does not rejoin" in r["time_to_full_size_note"]
    assert "failed: 0" in res.stdout


def test_the_report_measures_gaps_failures_and_rates_from_the_streams():
    bench = load_bench("bench_faults.py")
    args = bench.parse_args(["--before-s", "10", "--after-s", "10", "--output-len", "3"])
    # (prompt, start, token times, ids, error); the kill at t=10, recovery seen at t=12
    results = [
        (0, 0.0, [1.0, 2.0, 3.0], [5, 6, 7], None),
        (0, 9.0, [9.5, 12.5, 13.0], [5, 6, 7], None),  # waited 3 s across the kill
        (1, 14.0, [15.0, 15.2, 15.4], [8, 9, 9], None),
        (1, 16.0, [17.0], [8], "ended after 1 of 3 tokens"),
    ]
    gauges = {"afd_kv_pages_used": 4.0, "afd_prefix_cache_pages": 4.0}
    r = bench.report(args, results, 0.0, 20.0, 10.0, 12.0, gauges, 1.0, 0.0, True)
    assert r["requests"] == 4 and r["requests_failed"] == 1 and r["failures"] == ["ended after 1 of 3 tokens"]
    assert r["longest_token_gap_s"] == 3.0 and r["longest_gap_starts_after_kill_s"] == -0.5
    assert r["longest_gap_away_from_the_kill_s"] == 1.0  # the first token of a request, at t=14 to 15
    # before: from 2 s (a warm-up left out) to the kill, 3 tokens in 8 s; during: none; after: 6 in 8 s
    assert r["throughput_tok_s"] == {"before": 0.4, "during": 0.0, "after": 0.8}
    assert r["greedy_outputs_consistent"] is True and r["kv_pages_held_after_drain"] == 0.0
