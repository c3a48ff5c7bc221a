"""bench_afd_vs_colocated: both deployments served and swept, JSON and PNG written."""

from __future__ import annotations

import json
import subprocess
import sys


def test_quick_sweep_writes_json_and_png(tmp_path, tiny_v3):
    out, png = tmp_path / "avc.json", tmp_path / "avc.png"
    res = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_afd_vs_colocated.py",
            "--quick",
            "--model-path",
            tiny_v3,
            "--json",
            str(out),
            "--png",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert sorted(data["results"]) == ["afd 1A + 1F", "colocated dp2"]
    for points in data["results"].values():
        assert [p["concurrency"] for p in points] == [1, 4]
        assert all(p["failed"] == 0 and p["output_tok_s_per_worker"] > 0 and p["tpot_p50_ms"] > 0 for p in points)
    assert "ratio afd 1A + 1F / colocated dp2 at the SLO" in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
