"""benchmarks/bench_quality.py end to end on two short windows of the shipped model's held-out text:
the engine's fp32 perplexity equals transformers' and the JSON holds every figure."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from tests.process_helpers import ROOT

CONFIGS = ("single-fp32", "afd-fp8-bf16")
ROW_FIELDS = {"reference", "seconds", "windows", "tokens", "nll", "perplexity"}
ROW_FIELDS |= {"max_abs_logprob_diff", "mean_abs_logprob_diff"}


def test_bench_quality_small(tmp_path):
    out = tmp_path / "q.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_quality", "--windows", "2", "--window-len", "48"]
    cmd += ["--triton-windows", "0"]
    cmd += ["--configs", ",".join(CONFIGS), "--json", str(out)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"

    res = json.loads(out.read_text())
    assert res["config"]["configs"] == list(CONFIGS) and res["config"]["text_tokens"] > 1000
    rows = res["results"]
    assert set(rows) == {"transformers-fp32", *CONFIGS}
    for name, row in rows.items():
        assert ROW_FIELDS <= set(row), f"{name}: missing {ROW_FIELDS - set(row)}"
        assert (row["windows"], row["tokens"]) == (2, 96), name
        assert math.isclose(row["perplexity"], math.exp(row["nll"] / row["tokens"])), name
        assert 1.0 < row["perplexity"] < 2048, name  # a trained model beats the uniform 2048-token guess
    ref = rows["transformers-fp32"]
    assert ref["reference"] is None
    for name in CONFIGS:
        assert rows[name]["reference"] == "transformers-fp32" and rows[name]["flags"]
        assert math.isclose(rows[name]["rel_change"], rows[name]["perplexity"] / ref["perplexity"] - 1), name
    fp32 = rows["single-fp32"]
    assert abs(fp32["perplexity"] / ref["perplexity"] - 1) <= 1e-4, (fp32["perplexity"], ref["perplexity"])
    assert fp32["max_abs_logprob_diff"] <= 1e-4
    assert abs(rows["afd-fp8-bf16"]["rel_change"]) < 0.05  # fp8 dispatch moves perplexity by well under 5%
    for name in CONFIGS:
        assert f"\n{name} " in proc.stdout, f"{name} missing from the table:\n{proc.stdout}"
