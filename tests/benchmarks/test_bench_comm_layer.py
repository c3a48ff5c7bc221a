"""bench_comm_layer (benchmarks/kernels): one MoE layer's messages between two endpoints in one process, over the
in-process and the shared-memory transports; every combine must return what was dispatched."""

from __future__ import annotations

import json

from tests.process_helpers import bench_run


def test_both_transports_round_trip_exactly_and_report_per_layer_times(tmp_path):
    out = tmp_path / "layer.json"
    res = bench_run(
        "kernels/bench_comm_layer.py", "--tokens", "3", "--layers", "20", "--chunks", "3", "--json", str(out)
    )
    data = json.loads(out.read_text())
    assert set(data["transports"]) == {"inproc", "shm"}
    for r in data["transports"].values():
        assert len(r["chunks_us"]) == 3 and 0 < r["min_us"] <= r["median_us"]
    assert "inproc" in res.stdout and "shm" in res.stdout


def test_colocated_layout_keeps_its_share_and_adds_the_peers_weighted_copies(tmp_path):
    out = tmp_path / "layer.json"
    # top-4 of 8 experts over two ranks: the rank keeps some copies and sends the others to its peer
    args = ("--layout", "colocated", "--tokens", "5", "--topk", "4", "--layers", "10", "--chunks", "2")
    bench_run("kernels/bench_comm_layer.py", *args, "--json", str(out))
    data = json.loads(out.read_text())
    assert data["args"]["layout"] == "colocated"
    assert set(data["transports"]) == {"inproc", "shm"}
    for r in data["transports"].values():
        assert len(r["chunks_us"]) == 2 and 0 < r["min_us"] <= r["median_us"]
