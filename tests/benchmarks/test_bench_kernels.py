"""bench_kernels (benchmarks/kernels): every kernel of every backend runs, is timed, and agrees with
the torch reference."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


def test_quick_rows_cover_every_kernel_and_backend(tmp_path):
    out = tmp_path / "kernels.json"
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels.bench_kernels", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "triton rows run under the interpreter" in res.stdout
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and {"date", "machine", "commit"} <= set(report)  # stamped
    rows = {(r["kernel"], r["backend"]): r for r in report["rows"]}
    assert set(rows) == {(k, b) for k in ("mla_decode", "fused_moe", "fp8_quantize") for b in ("torch", "triton")}
    for (kernel, backend), r in rows.items():
        assert r["us"] > 0 and r["gb_s"] > 0 and r["tflop_s"] > 0, (kernel, backend)
        assert r["hbm_fraction"] is None  # no GPU: no peak to compare with
        assert r["max_rel_err_vs_torch"] < (0 if kernel == "fp8_quantize" else 1e-4) + 1e-12, (kernel, backend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the full shapes run")
def test_full_shapes_need_a_gpu():
    cmd = [sys.executable, "-m", "benchmarks.kernels.bench_kernels"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "need a GPU" in res.stderr
