"""bench_pipeline runs the real AFD pipeline with injected delays and draws its timeline."""

from __future__ import annotations

import json

from tests.process_helpers import bench_run


def test_quick_run_records_a_timeline_and_busy_fractions(tmp_path):
    out, png = tmp_path / "pipe.json", tmp_path / "pipe.png"
    res = bench_run("bench_pipeline.py", "--quick", "--json", str(out), "--png", str(png), timeout=300)
    results = json.loads(out.read_text())["results"]
    assert [r["micro_batches"] for r in results] == [1, 3]
    assert all(0 < r["a_busy"] <= 1 and r["decode_steps"] >= 1 for r in results)
    # the planner's formula, fed the stage times of the same run: one micro-batch waits on every round trip
    one, three = results
    assert one["predicted_a_busy"] < three["predicted_a_busy"] <= 1
    assert one["measured_attention_ms"] >= 20 and one["measured_ffn_ms"] >= 8  # the injected delays
    assert "planner" in res.stdout
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "A busy" in res.stdout
