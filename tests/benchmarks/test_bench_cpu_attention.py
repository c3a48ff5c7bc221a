"""bench_cpu_attention (benchmarks/kernels): the C MLA decode kernel against the torch reference in one process (the
step times are the benchmark's, not asserted; what it reports about them is)."""

from __future__ import annotations

import json

import pytest

from tests.process_helpers import bench_run


@pytest.mark.timeout(200)
def test_quick_run_reports_both_backends_per_block_and_their_tokens(tmp_path):
    out = tmp_path / "cpu_attention.json"
    res = bench_run(
        "kernels/bench_cpu_attention.py", "--quick", "--model-path", str(tmp_path / "model"), "--json", str(out)
    )
    data = json.loads(out.read_text())
    assert (data["running"], data["input_len"], data["output_len"], data["block"]) == (4, 8, 12, 4)
    # 12 tokens in blocks of 4: three blocks, the first (prefill) left out
    assert len(data["blocks_ms"]) == 2 and all(set(b) == {"torch", "cpu"} for b in data["blocks_ms"])
    for backend in ("torch", "cpu"):
        assert data["step_ms"][backend] == pytest.approx(sum(b[backend] for b in data["blocks_ms"]) / 2)
    assert data["torch_over_cpu"] == data["step_ms"]["torch"] / data["step_ms"]["cpu"]
    # both engines decode the same greedy tokens on this checkpoint
    assert data["requests"] == 4 and data["identical_outputs"] == 4
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["context", "torch", "ms", "cpu", "ms", "torch/cpu"]
    assert [line.split()[0] for line in lines[1:4]] == ["12", "16", "mean"]
    assert lines[-1] == "identical greedy outputs: 4 of 4"
