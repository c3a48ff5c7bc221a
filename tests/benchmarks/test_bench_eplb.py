"""bench_eplb: skewed routing balanced in the synthetic DSv3 shape and in a served model, and a
rebalance under load that loses no request (the timing figures are the benchmark's, not asserted)."""

from __future__ import annotations

import json

import pytest

from tests.process_helpers import bench_run


@pytest.mark.timeout(400)
def test_quick_run_balances_skewed_routing_and_rebalances_under_load(tmp_path):
    out = tmp_path / "eplb.json"
    res = bench_run("bench_eplb.py", "--quick", "--serve", "--json", str(out), timeout=380)
    data = json.loads(out.read_text())

    syn = data["synthetic"]
    assert syn["imbalance_after"] <= 1.15 < 1.5 < syn["imbalance_before"]
    # the same routed pairs, spread differently: 8 senders x 128 tokens x top-8
    assert sum(syn["rank_pairs_before"]) == sum(syn["rank_pairs_after"]) == 8 * 128 * 8
    assert len(syn["rank_pairs_after"]) == 16

    model = data["model"]
    assert model["switch_steps"] and model["placements"] >= 1
    before, after = model["before"], model["after"]
    assert data["imbalance_before"] == before["imbalance"] and data["imbalance_after"] == after["imbalance"]
    assert after["imbalance"] <= 1.15 < before["imbalance"]
    assert len(before["rank_pairs"]) == len(after["rank_pairs"]) == 4
    assert data["throughput_before"] > 0 and data["throughput_after"] > 0

    load = data["under_load"]
    assert load["requests"] == 24 and load["failed"] == 0  # --quick: 24 requests, none lost
    assert load["switches"] >= 2 and load["rebalance_steps"] >= 2 * load["switches"] - 1
    assert load["worst_rebalance_step_ms"] > 0
    assert "imbalance" in res.stdout and "under load" in res.stdout
