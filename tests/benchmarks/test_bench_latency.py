"""bench_latency: TPOT at concurrency 1 of single mode and of deployments, all servers up at once and
measured in rounds, as ratios to the faster single-mode run of the same round (the figures
themselves are the benchmark's, not asserted)."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.process_helpers import bench_run, load_bench

bench_latency = load_bench("bench_latency.py")


@pytest.mark.timeout(300)
def test_quick_run_reports_every_deployment_against_the_faster_single_run_of_each_round(tmp_path, tiny_v3):
    out = tmp_path / "latency.json"
    res = bench_run("bench_latency.py", "--quick", "--model-path", tiny_v3, "--json", str(out), timeout=280)
    data = json.loads(out.read_text())
    rows = data["deployments"]
    assert list(rows) == ["single 1 thread", "single 2 threads", "afd 1A+1F mb3 shm"]
    singles = ("single 1 thread", "single 2 threads")
    base_by_round = [min(rows[n]["repeats_ms"][i] for n in singles) for i in range(2)]
    for r in rows.values():
        assert len(r["repeats_ms"]) == 2 and min(r["repeats_ms"]) > 0
        assert r["tpot_p50_ms"] == statistics.median(r["repeats_ms"])
        assert r["ratios"] == [t / b for t, b in zip(r["repeats_ms"], base_by_round)]
        assert r["vs_single"] == statistics.median(r["ratios"])
        lo, hi = r["vs_single_95"]
        assert min(r["ratios"]) <= lo <= r["vs_single"] <= hi <= max(r["ratios"])
    medians = {n: rows[n]["tpot_p50_ms"] for n in singles}
    assert data["baseline"] == min(medians, key=medians.get)
    assert data["baseline_tpot_ms"] == min(medians.values())
    assert res.stdout.splitlines()[0].split()[:3] == ["deployment", "TPOT", "p50"]
    assert res.stdout.count("(baseline)") == 1 and len(res.stdout.splitlines()) == 4


def test_the_interval_of_a_median_narrows_with_rounds_and_is_reproducible():
    few = [1.0, 2.0, 3.0]
    assert bench_latency.median_interval(few) == [1.0, 3.0]  # resamplings of 3 give every median
    many = [1.0 + (i * 37 % 200) / 2000 for i in range(200)]  # 1.0000-1.0995, shuffled
    lo, hi = bench_latency.median_interval(many)
    assert 1.035 <= lo < statistics.median(many) < hi <= 1.065
    assert bench_latency.median_interval(many) == [lo, hi]  # seeded: the same report for the same rounds
    assert bench_latency.median_interval(many, seed=1) != [lo, hi]
    assert bench_latency.median_interval([1.4] * 5) == [1.4, 1.4]


def test_a_run_without_a_single_mode_baseline_is_refused():
    with pytest.raises(AssertionError, match="needs a single-mode baseline"):
        bench_run("bench_latency.py", "--deployments", "colocated dp2 shm", timeout=60)
