"""benchmarks/bench_spec.py end to end (--quick, on the embedded model with its MTP head): the JSON
has every (mode, steps, concurrency) row, speculation's outputs equal speculation off's, and the
accepted length is measured (no speed threshold)."""

from __future__ import annotations

import json

from tests.process_helpers import bench_run


def test_bench_spec_quick(tmp_path):
    out = tmp_path / "spec.json"
    bench_run("bench_spec.py", "--quick", "--num-threads", "1", "--json", str(out))
    record = json.loads(out.read_text())
    rows = record["results"]
    assert [(r["mode"], r["steps"], r["concurrency"]) for r in rows] == [
        ("single", 0, 1),
        ("single", 1, 1),
        ("single", 0, 2),
        ("single", 1, 2),
    ]
    for off, on in zip(rows[::2], rows[1::2]):
        assert off["accepted_length"] is None and on["exact"] is True
        assert 1.0 <= on["accepted_length"] <= 2.0
        assert on["tpot_vs_off"] == round(on["tpot_ms"] / off["tpot_ms"], 3)
        assert off["output_tokens_per_s"] > 0 and on["output_tokens_per_s"] > 0
    assert rows[1]["accepted_length"] > 1.0  # the shipped head's drafts are accepted at all
    assert record["model_path"] == "embedded default model" and record["commit"] is not None
