"""Smoke test of benchmarks/bench_offline.py: runs end to end and writes sane JSON (no speed threshold)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_offline.py"


def test_bench_offline_quick(tmp_path):
    out = tmp_path / "x.json"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--num-threads", "1", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "ratio (afd / transformers) output tok/s:" in proc.stdout

    res = json.loads(out.read_text())
    batch, output_len = res["config"]["batch_size"], res["config"]["output_len"]
    assert (batch, output_len) == (4, 8)
    assert set(res["results"]) == {"afd", "transformers"}
    for name, side in res["results"].items():
        assert side["output_tokens"] == batch * output_len, name
        assert side["seconds"] > 0 and side["output_tok_s"] > 0, name
        assert math.isclose(side["output_tok_s"], side["output_tokens"] / side["seconds"]), name
    ratio = res["ratio_output_tok_s"]
    assert isinstance(ratio, float) and math.isfinite(ratio) and ratio > 0
    g = res["greedy_match"]
    assert g["sequences"] == batch and 0 <= g["identical_sequences"] <= batch
