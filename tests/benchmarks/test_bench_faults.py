"""bench_faults: an FFN node killed under streaming load costs no request and no token, a
replacement brings the deployment back to full size, and the report says how long the streams
waited and what the recovery did; the other scenarios (an attention rank killed, a drain, a PD
decode instance killed) report the same figures of their streams and their own, from the flags
each scenario and --quick set."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from benchmarks.faults import attention, drain, ffn, pd, procs
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
    r = ffn.report(args, results, 0.0, 30.0, events, gauges, 2.0, 6.0, True)
    assert r["requests"] == 4 and r["requests_failed"] == 1 and r["failures"] == ["ended after 1 of 3 tokens"]
    assert r["longest_token_gap_s"] == 3.0 and r["longest_gap_starts_after_kill_s"] == -0.5
    assert r["longest_gap_away_from_the_kill_s"] == 1.0  # the first token of a request, at t=14 to 15
    # before: from 2 s (a warm-up left out) to the kill, 3 tokens in 8 s; during: none in 2 s;
    # degraded (12-16 s): 5 in 4 s; rejoined (16-30 s): 1 in 14 s
    assert r["throughput_tok_s"] == {"before": 0.4, "during_recovery": 0.0, "degraded": 1.2, "rejoined": 0.1}
    assert r["time_to_full_size_s"] == 2.0
    assert r["greedy_outputs_consistent"] is True and r["kv_pages_held_after_drain"] == 0.0
    # in flight at the kill: the request started at 9 s alone; its next token came at 12.5 s
    assert r["streams_in_flight_at_kill"] == 1 and r["time_to_resume_s"] == 2.5
    assert not ffn.passed(args, r)  # a request failed
    del events["full"]
    r = ffn.report(args, results, 0.0, 30.0, events, gauges, 1.0, 6.0, True)
    assert r["time_to_full_size_s"] is None
    del events["recovered"]
    r = ffn.report(args, results, 0.0, 30.0, events, gauges, 1.0, 6.0, True)
    assert r["recovery_seen_after_kill_s"] is None and "recovery reported : never" in ffn.format_report(r)


def test_each_scenario_sets_its_defaults_and_quick_run_and_flags_given_win():
    bench = load_bench("bench_faults.py")
    a = bench.parse_args([])
    assert (a.scenario, a.deployment, a.before_s, a.after_s, a.rejoin_after_s) == ("ffn", ffn.DEPLOYMENT, 20, 60, 10)
    assert (a.concurrency, a.output_len) == (8, 64)
    a = bench.parse_args(["--quick"])
    assert (a.before_s, a.after_s, a.rejoin_after_s, a.concurrency, a.output_len) == (4, 14, 2, 4, 32)
    a = bench.parse_args(["--scenario", "attention", "--quick", "--concurrency", "6"])
    assert (a.deployment, a.before_s, a.after_s, a.concurrency, a.output_len) == (attention.DEPLOYMENT, 4, 12, 6, 32)
    a = bench.parse_args(["--scenario", "drain"])
    assert (a.concurrency, a.output_len, a.drain_timeout) == (8, 256, 60)
    a = bench.parse_args(["--scenario", "drain", "--quick"])
    assert (a.concurrency, a.output_len, a.drain_timeout) == (8, 128, 30)
    a = bench.parse_args(["--scenario", "pd", "--quick", "--deployment", "--mode single --dtype float32"])
    assert (a.deployment, a.before_s, a.after_s, a.victim_decode) == ("--mode single --dtype float32", 4, 12, 0)


def test_the_attention_report_times_the_resumption_of_the_streams_in_flight():
    args = load_bench("bench_faults.py").parse_args(
        ["--scenario", "attention", "--before-s", "10", "--output-len", "3"]
    )
    # (prompt, start, token times, ids, error); the kill at 10 s, seen on /metrics at 10.25 s, the load ends at 19 s
    results = [
        (0, 0.0, [1.0, 2.0, 3.0], [5, 6, 7], None),  # done before the kill
        (0, 9.0, [9.5, 11.5, 12.0], [5, 6, 7], None),  # moved: its next token 1.5 s after the kill
        (1, 9.8, [10.3, 10.4, 10.5], [8, 9, 9], None),  # waiting for its first token at the kill
        (1, 12.0, [12.2], [8], "error event: lost"),
        (1, 13.0, [13.1, 13.2, 13.3], [8, 9, 9], None),
    ]
    gauges = {"afd_kv_pages_used": 5.0, "afd_prefix_cache_pages": 3.0}
    after = {"resumed": 1.0, "alive": 1.0, "healthy": True}
    r = attention.report(args, results, 0.0, 19.0, {"kill": 10.0, "lost": 10.25}, gauges, 2.0, after)
    assert (r["requests"], r["requests_failed"], r["failures"]) == (5, 1, ["error event: lost"])
    assert r["longest_token_gap_s"] == 2.0 and r["longest_gap_starts_after_kill_s"] == -0.5
    assert r["streams_in_flight_at_kill"] == 2 and r["time_to_resume_s"] == 1.5
    assert r["loss_seen_after_kill_s"] == 0.25 and r["greedy_outputs_consistent"] is True
    # before: 3 tokens from 2 s to the kill; degraded (no replacement): 9 in 9 s
    assert r["throughput_tok_s"] == {"before": 0.4, "degraded": 1.0, "rejoined": None}
    assert r["replacement_serving_after_kill_s"] is None
    assert (r["requests_resumed"], r["attention_ranks_alive_before"], r["attention_ranks_alive_at_end"]) == (1, 2, 1)
    assert r["kv_pages_held_after_drain"] == 2.0 and r["healthy_at_end"] is True
    text = attention.format_report(r)
    assert "requests: 5, failed: 1\n  error event: lost\n" in text
    assert "time to resume: 1.50 s from the kill until the last of the 2 streams in flight had its next token" in text
    assert "requests resumed: 1; attention ranks alive: 2 before, 1 at the end" in text
    assert "a replacement serving : none by the end" in text
    events = {"kill": 10.0, "lost": 10.25, "rejoined": 13.0}  # a replacement serves from 13 s
    r = attention.report(args, results, 0.0, 19.0, events, gauges, 2.0, after)
    assert r["replacement_serving_after_kill_s"] == 3.0
    assert r["throughput_tok_s"] == {"before": 0.4, "degraded": 2.0, "rejoined": 0.5}
    assert "a replacement serving 3.00 s after the kill" in attention.format_report(r)
    assert not attention.passed(args, r)
    assert attention.passed(args, attention.report(args, results[:3], 0.0, 28.0, {"kill": 10.0}, gauges, 2.0, after))


def test_the_drain_report_counts_the_refusals_and_checks_the_streams_against_the_undisturbed_run():
    args = load_bench("bench_faults.py").parse_args(["--scenario", "drain", "--output-len", "2", "--concurrency", "2"])
    undisturbed = [(0, 0.0, [0.5, 0.6], [1, 2], None), (1, 0.0, [0.5, 0.7], [3, 4], None)]
    drained = [(0, 1.0, [1.5, 2.6], [1, 2], None), (1, 1.0, [1.5, 3.0], [3, 4], None)]
    timings = {"signal": 2.0, "streams_done": 3.1, "exit": 4.5, "exit_status": 0}
    refusals = ["503 Retry-After: 1"] * 3 + ["200", "503"]  # (a 503 without Retry-After is no drain's)
    r = drain.report(args, undisturbed, drained, timings, refusals, "503 draining")
    assert (r["requests"], r["requests_failed"], r["streams_in_flight_at_signal"]) == (2, 0, 2)
    assert r["longest_token_gap_s"] == 1.5 and r["longest_gap_starts_after_signal_s"] == -0.5
    assert r["time_to_resume_s"] == 1.0 and r["greedy_outputs_consistent"] is True
    assert (r["new_requests_during_drain"], r["new_requests_refused_503"]) == (5, 3)
    assert r["new_requests_otherwise"] == ["200", "503"]
    assert (r["streams_done_after_signal_s"], r["exit_after_signal_s"], r["exit_status"]) == (1.1, 2.5, 0)
    text = drain.format_report(r)
    assert "new requests during the drain: 5, 503 with Retry-After: 3, otherwise: ['200', '503']" in text
    assert "/health during the drain: 503 draining" in text
    assert "streams done 1.10 s after SIGTERM; the server exited after 2.50 s with status 0" in text
    assert not drain.passed(args, r)  # a new request was served
    r = drain.report(args, undisturbed, drained, timings, refusals[:3], "503 draining")
    assert drain.passed(args, r)
    assert not drain.passed(args, drain.report(args, undisturbed, drained, {**timings, "exit_status": 143}, [], None))
    other = [(1, 1.0, [1.5, 3.0], [3, 5], None)]  # greedy, yet not the undisturbed tokens
    r = drain.report(args, undisturbed, drained[:1] + other, timings, refusals[:3], "503 draining")
    assert r["greedy_outputs_consistent"] is False and not drain.passed(args, r)


def test_the_pd_report_gives_the_router_failovers_and_what_the_survivors_hold():
    args = load_bench("bench_faults.py").parse_args(["--scenario", "pd", "--before-s", "4", "--output-len", "2"])
    results = [
        (0, 3.0, [3.5, 5.0], [1, 2], None),
        (1, 4.5, [4.6, 4.7], [3, 4], None),
        (0, 5.0, [5.2, 5.3], [1, 2], None),
    ]
    after = {"resume": 1.0, "resend": 0.0, "healthy": True, "held": {"prefill": 0.0, "decode": 2.0}}
    r = pd.report(args, results, 0.0, 10.0, {"kill": 4.0}, after)  # the router never marked it lost
    assert (r["requests"], r["requests_failed"], r["streams_in_flight_at_kill"], r["time_to_resume_s"]) == (
        3,
        0,
        1,
        1.0,
    )
    assert r["longest_token_gap_s"] == 1.5 and r["loss_seen_after_kill_s"] is None
    assert r["throughput_tok_s"] == {"before": 0.5, "after": 0.8}
    assert r["router_failovers"] == {"resume": 1.0, "resend": 0.0}
    text = pd.format_report(r)
    assert "the router marked it lost : never" in text and "router failovers: resumed 1, sent again 0" in text
    assert "KV pages held after the drain: prefill 0, surviving decode 2; router healthy: True" in text
    assert pd.passed(args, r)


def test_a_process_is_found_among_the_descendants_by_its_title():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert child.pid in procs.descendants(os.getpid())
        assert procs.titled(os.getpid(), "sleep") == child.pid
        with pytest.raises(LookupError, match="0 processes titled 'afd::attention-1'"):
            procs.titled(os.getpid(), "afd::attention-1")
    finally:
        child.kill()
        child.wait()
