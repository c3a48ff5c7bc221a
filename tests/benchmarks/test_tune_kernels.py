"""tune_kernels: the dry run sweeps every section's tiles on the CPU (Triton's interpreter), checks each
configuration against its reference before timing it, and names the fastest per shape."""

from __future__ import annotations

import json
import subprocess
import sys


def test_dry_run_sweeps_every_section(tmp_path):
    out = tmp_path / "tune.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/tune_kernels.py", "--dry-run", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert set(sections) == {"ceilings", "mla", "moe_bf16", "moe_fp8"}
    assert sections["ceilings"]["skipped"] == "no GPU"
    mla = sections["mla"]
    # 2 tiles x 2 split counts at the primary shape, then the same at the one grid shape
    assert len(mla["rows"]) == 8 and mla["wrong"] == []
    checked = [r for r in mla["rows"] if "rel_err" in r]
    assert len(checked) == 2 and all(r["rel_err"] < 1e-2 for r in checked)  # bf16 inputs
    assert {(b["batch"], b["context"]) for b in mla["best"]} == {(2, 40), (2, 100)}
    for name, tiles in (("moe_bf16", 2), ("moe_fp8", 1)):
        sec = sections[name]
        assert sec["wrong"] == [] and len(sec["rows"]) == 2 * tiles  # each tile at 1 and 4 rows per expert
        assert all(r["us"] > 0 and {"gb_s", "tflop_s"} <= r.keys() for r in sec["rows"])
        assert [b["tokens_per_expert"] for b in sec["best"]] == [1, 4]
    assert "mla v3" in proc.stdout and "moe_fp8 tpe 4" in proc.stdout
