"""bench_overhead: every part of a decode step measured, for each running-request count asked for."""

from __future__ import annotations

import json

from tests.process_helpers import bench_run

PARTS = ["step_ms", "forward_ms", "sample_ms", "build_ms", "schedule_ms", "finish_ms", "encode_ms", "encode (json)_ms"]


def test_small_run_reports_each_part_of_the_step(tmp_path, tiny_v3):
    out = tmp_path / "overhead.json"
    res = bench_run(
        "bench_overhead.py", "--model-path", tiny_v3, "--running", "8", "24", "--steps", "3", "--json", str(out)
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["running"], r["overlap"]) for r in rows] == [(8, False), (8, True), (24, False), (24, True)]
    for r in rows:
        assert all(r[p] > 0 for p in PARTS), r
        assert r["forward_ms"] < r["step_ms"] and 0 < r["outside_forward"] < 1
        assert r["outside_forward"] == 1 - r["forward_ms"] / r["step_ms"]
    assert "outside" in res.stdout and res.stdout.count("\n") == 5  # header + one line per count and mode
