"""Expert load statistics over HTTP: GET /expert_load, the /metrics gauges and `afd expert-load`,
from a colocated deployment that rebalances while it serves."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.engine_helpers import random_prompts
from tests.process_helpers import afd_run
from tests.server.conftest import Server

KEY = "admin-key"
TOP_K = 4  # the tiny model's experts per token


@pytest.fixture(scope="module")
def eplb_server(tiny_v3):
    flags = "--mode colocated --dp-size 2 --ep-num-redundant-experts 2 --enable-eplb"
    flags += " --eplb-rebalance-num-iterations 4 --eplb-window-steps 100000 --api-key " + KEY
    srv = Server(tiny_v3, *flags.split())
    yield srv
    srv.stop()


def _generate(server, prompts, max_tokens: int) -> None:
    for ids in prompts:
        body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text


@pytest.mark.timeout(240)
def test_expert_load_counts_every_routed_token_and_feeds_metrics_and_cli(eplb_server, tmp_path):
    server = eplb_server
    prompts = random_prompts(500, [13, 7, 21, 9, 30, 11], seed=5, low=10)
    _generate(server, prompts, max_tokens=6)
    assert httpx.get(server.url + "/expert_load").status_code == 401  # an admin route: behind the key
    report = httpx.get(server.url + "/expert_load", headers={"Authorization": f"Bearer {KEY}"}).json()

    # every forwarded token (prompt, then each generated token but the last) routed top-4 per layer
    forwarded = sum(len(p) + 6 - 1 for p in prompts)
    assert report["attention_ranks"] == 2 and report["num_experts"] == 16
    assert [sum(layer) for layer in report["load"]] == [TOP_K * forwarded] * len(report["moe_layers"])
    assert report["placement"]["version"] >= 1, "no rebalance happened"
    assert report["placement"]["slots_per_rank"] == 9  # (16 + 2) / 2
    assert sum(report["expert_rank_load"]) == pytest.approx(TOP_K * forwarded * len(report["moe_layers"]))
    loads = report["expert_rank_load"]
    assert report["imbalance"] == pytest.approx(max(loads) / (sum(loads) / len(loads)))

    deadline = time.monotonic() + 10  # the gauges follow the engines' heartbeats
    while time.monotonic() < deadline:
        gauges = [server.metric(f'afd_expert_rank_load{{rank="{r}"}}') for r in range(2)]
        if gauges == pytest.approx(loads):
            break
        time.sleep(0.3)
    assert gauges == pytest.approx(loads)
    assert server.metric("afd_expert_rank_imbalance") == pytest.approx(report["imbalance"])

    out = tmp_path / "load.json"
    run = afd_run("expert-load", "--url", server.url, "--api-key", KEY, "--output", str(out))
    assert run.returncode == 0, run.stderr
    assert f"placement {report['placement']['version']}," in run.stdout and "imbalance" in run.stdout
    assert json.loads(out.read_text())["load"] == report["load"]
    denied = afd_run("expert-load", "--url", server.url)
    assert denied.returncode == 2 and "401" in denied.stderr
