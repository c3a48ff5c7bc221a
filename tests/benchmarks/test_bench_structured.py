"""bench_structured: the overhead and compile parts in a small run (the validity part's requests are
the API tests' own: tests/server/test_structured_api.py)."""

from __future__ import annotations

import json

from tests.process_helpers import bench_run


def test_quick_run_reports_step_ratio_and_compile_times(tmp_path):
    out = tmp_path / "structured.json"
    res = bench_run("bench_structured.py", "--quick", "--parts", "overhead", "compile", "--json", str(out))
    r = json.loads(out.read_text())
    o, c = r["overhead"], r["compile"]
    assert o["running"] == 32 and o["steps_timed"] == 8
    assert o["ratio"] == o["constrained_step_ms"] / o["plain_step_ms"] and o["plain_step_ms"] > 0
    assert c["guides"] == 3 and c["vocab_size"] == 2048
    assert 0 < c["cached_us_median"] * 1e-3 < c["cold_ms_median"]
    assert "all constrained" in res.stdout and "validity" not in r
