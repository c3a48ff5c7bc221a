"""bench_latency: TPOT at concurrency 1 of single mode and of deployments, all servers up at once and
measured in rounds, as ratios to the faster single-mode run of the same round (the figures
themselves are the benchmark's, not asserted)."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.process_helpers import bench_run


@pytest.mark.timeout(300)
def test_quick_run_reports_every_deployment_against_the_faster_single_run_of_each_round(tmp_path, tiny_v3):
    out = tmp_path / "latency.json"
    res = bench_run("bench_latency.py", "--quick", "--model-path", tiny_v3, "--json", str(out), timeout=280)
    data = json.loads(out.read_text())
    rows = data["deployments"]
    assert list(rows) == ["single 1 thread", "single 2 threads", "afd 1A+1F mb3 shm", "colocated dp2 shm"]
    singles = ("single 1 thread", "single 2 threads")
    base_by_round = [min(rows[n]["repeats_ms"][i] for n in singles) for i in range(2)]
    for r in rows.values():
        assert len(r["repeats_ms"]) == 2 and min(r["repeats_ms"]) > 0
        assert r["tpot_p50_ms"] == statistics.median(r["repeats_ms"])
        assert r["ratios"] == [t / b for t, b in zip(r["repeats_ms"], base_by_round)]
        assert r["vs_single"] == statistics.median(r["ratios"])
    medians = {n: rows[n]["tpot_p50_ms"] for n in singles}
    assert data["baseline"] == min(medians, key=medians.get)
    assert data["baseline_tpot_ms"] == min(medians.values())
    assert res.stdout.splitlines()[0].split()[:3] == ["deployment", "TPOT", "p50"]
    assert res.stdout.count("(baseline)") == 1 and len(res.stdout.splitlines()) == 5


def test_a_run_without_a_single_mode_baseline_is_refused():
    with pytest.raises(AssertionError, match="needs a single-mode baseline"):
        bench_run("bench_latency.py", "--deployments", "colocated dp2 shm", timeout=60)
