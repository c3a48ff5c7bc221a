"""Elastic experts (--enable-ffn-fault-tolerance): an FFN rank may hold more expert slots than it
started with, up to --ffn-expert-memory-mb, and experts a live rank of its node holds come from
that rank instead of the checkpoint.

- Without a single redundant copy, losing one of two FFN ranks mid-decode still loses no request
  and no token: the survivor grows from 8 to 16 slots per layer and reads the lost experts from
  the checkpoint (eagerly, and on the static-decode path whose guard watches the weights move).
- A rebalance between live ranks reads nothing from the checkpoint (its weights are removed once the
  deployment is up): every expert it moves comes from the rank that holds it.
- A replacement of the lost rank, started empty, gets all its experts from the survivor that grew.
- With a cap too small to hold every expert, the recovery is refused in one line naming the flag.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from afd_engine import Engine, SamplingParams, make_engine
from tests.distributed.test_ffn_fault_tolerance import FT, GREEDY, ffn_pid, run_with_kill, settled_stats
from tests.engine_helpers import run_staggered, staggered_reference
from tests.process_helpers import free_port, launched_roles, wait_healthy

LENGTHS = [5, 9, 17, 3, 12, 7, 21, 4]
LAYERS = 3  # MoE layers of the tiny model: each lost expert is loaded once per layer


@pytest.fixture(scope="module")
def reference(tiny_v3):
    return staggered_reference(tiny_v3, LENGTHS, GREEDY, seed=5)


# name: (flags, the survivor's slots per layer after the recovery, experts it reads per layer)
GROWTH = {
    # 16 experts on 2 ranks, no copy: rank 1's 8 experts exist nowhere else; rank 0 grows 8 -> 16
    "no redundant copy, eager": (dict(), [16, 8], 8),
    "no redundant copy, static decode": (dict(static_decode=True), [16, 8], 8),
    # 16 + 2 slots: each rank holds one copy of experts 0 and 1 and 7 experts of its own
    "2 redundant copies": (dict(ep_num_redundant_experts=2), [16, 9], 7),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(GROWTH))
def test_a_survivor_grows_to_hold_every_expert_and_no_token_changes(name, tiny_v3, reference):
    """1A + 1x2: FFN rank 1 is killed mid-decode; rank 0 may hold twice the slots it starts with
    (the CPU default) and grows to hold every expert."""
    prompts, expected = reference
    flags, sizes, read = GROWTH[name]
    with make_engine(model_path=tiny_v3, dp_size=1, ffn_ranks_per_node=2, **flags, **FT) as engine:
        outs = run_with_kill(engine, prompts, ffn_pid(1, 2), after_tokens=40)
        assert outs == expected
        stats = settled_stats(engine)
        assert (stats.ffn_recoveries, stats.ffn_ranks_alive, stats.ffn_experts_read) == (1, 1, read * LAYERS)
        assert (stats.experts_loaded_peer, stats.experts_loaded_checkpoint) == (0, read * LAYERS)
        assert stats.running == 0 and stats.kv_pages_used == stats.cache_pages
        placement = engine.expert_load()["placement"]
        assert placement["dead"] == [1] and placement["sizes"] == sizes
        for slots in placement["slot_expert"].values():
            assert sorted(slots[: sizes[0]]) == list(range(16))  # rank 0 holds every expert
        again = engine.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert [o.token_ids for o in again] == expected
        if flags.get("static_decode"):  # the static path ran on the grown weights (its guard moved with them)
            assert settled_stats(engine).static_decode_batches > stats.static_decode_batches > 0


@pytest.mark.timeout(120)
def test_a_cap_too_small_for_every_expert_refuses_the_recovery_in_one_line(tiny_v3):
    """A slot is 72 KiB (3 MoE layers of 24 KiB): 0.9 MiB holds 12, and rank 0 would need 16. The
    cap reaches the attention ranks with rank 0's heartbeats."""
    flags = dict(dp_size=1, ffn_ranks_per_node=2, ffn_expert_memory_mb=0.9)
    with make_engine(model_path=tiny_v3, **flags, **FT) as engine:
        os.kill(ffn_pid(1, 2), signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(Exception) as err:
            engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)
        assert time.monotonic() - start < 30, err.value
    line = next(m for m in str(err.value).splitlines() if "cannot serve" in m)
    assert "cannot serve without FFN rank(s) [1]: MoE layer 1 without expert ranks [1]: 8 experts lost their " in line
    assert "the survivors may grow by 4 slots within their --ffn-expert-memory-mb caps (rank 0: 12 slots" in line
    assert "; start with a larger --ffn-expert-memory-mb, more --ep-num-redundant-experts or more FFN ranks" in line


REBALANCE = dict(enable_eplb=True, eplb_rebalance_num_iterations=3)


@pytest.mark.timeout(300)
def test_a_rebalance_between_live_ranks_copies_experts_from_peers_and_reads_no_checkpoint(tiny_v3, tmp_path):
    """1A + 1x2 with 2 redundant slots, rebalanced every 3 steps from the measured load: every
    expert a rank gains is held by the other one. The checkpoint's weights are removed once the
    deployment is up, so a read would fail the staging (and the deployment)."""
    prompts, expected = staggered_reference(tiny_v3, LENGTHS, GREEDY, seed=11)
    model = Path(shutil.copytree(tiny_v3, tmp_path / "model"))
    flags = dict(mode="afd", dp_size=1, ffn_ranks_per_node=2, ep_num_redundant_experts=2, **REBALANCE)
    with make_engine(model_path=str(model), num_threads=1, comm_timeout=30, dispatch_dtype="fp32", **flags) as engine:
        for f in model.glob("*.safetensors"):
            f.unlink()
        for _ in range(4):  # staging runs beside the steps: rounds until a placement was switched in
            assert run_staggered(engine, prompts, GREEDY, every=2) == expected
            if engine.expert_load()["placement"]["version"] >= 1:
                break
        assert engine.expert_load()["placement"]["version"] >= 1
        stats = settled_stats(engine)
    assert stats.experts_loaded_checkpoint == 0 and stats.experts_loaded_peer > 0, stats


def zero_weights(model: Path) -> None:
    """Every tensor of the checkpoint's safetensors files set to zero bytes, the headers kept."""
    for f in model.glob("*.safetensors"):
        with open(f, "r+b") as out:
            start = 8 + int.from_bytes(out.read(8), "little")
            out.seek(start)
            out.write(bytes(f.stat().st_size - start))


ROLES = (
    "--mode afd --dp-size 1 --ffn-nodes 1 --ffn-ranks-per-node 2 --enable-ffn-fault-tolerance --comm-timeout 5 "
    "--num-threads 1 --served-model-name tiny --dispatch-dtype fp32"
).split()


@pytest.mark.timeout(300)
def test_a_replacement_gets_its_experts_from_the_survivor_that_grew(tiny_v3, tmp_path):
    """Roles on one machine: one FFN node of two ranks and no redundant copy. Rank 1's process is
    killed: rank 0 grows to every expert (read from the checkpoint). The same FFN role started again
    replaces rank 1, which starts empty and copies its 8 experts per layer from rank 0: the
    checkpoint's weights are zeros by then (a role checks the files' headers at start, so they
    stay), and an expert read from it would change the tokens, which stay the single engine's."""
    model = Path(shutil.copytree(tiny_v3, tmp_path / "model"))
    rdv, port = f"127.0.0.1:{free_port()}", free_port()
    common = ["--dist-init-addr", rdv, "--model-path", str(model), *ROLES]
    prompts = ["across machines", "a rank is lost", "and comes back"]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    with Engine(model_path=tiny_v3, num_threads=1) as single:
        expected = [o.text for o in single.generate(prompts=prompts, sampling_params=params)]
    with launched_roles(tmp_path, common) as role:
        procs = [role("--role", "ffn", "--node-rank", "0"), role("--role", "attention", "--port", str(port))]
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc=None)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

        def texts() -> list[str]:
            body = {"ignore_eos": True}
            outs = [
                client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, extra_body=body)
                for p in prompts
            ]
            return [o.choices[0].text for o in outs]

        def metrics() -> dict[str, float]:
            lines = httpx.get(url + "/metrics").text.splitlines()
            return {ln.split()[0]: float(ln.split()[1]) for ln in lines if ln.startswith("afd_")}

        assert texts() == expected
        os.kill(ffn_pid(1, 2), signal.SIGKILL)  # one rank, not its role: rank 0 serves on
        assert texts() == expected
        m = metrics()
        assert (m["afd_ffn_ranks_alive"], m["afd_ffn_recoveries_total"]) == (1, 1)
        assert m['afd_experts_loaded_total{source="checkpoint"}'] == 8 * LAYERS
        placement = httpx.get(url + "/expert_load").json()["placement"]
        assert all(len(slots) == 16 + 8 for slots in placement["slot_expert"].values())  # rank 0's 16, the lost 8
        zero_weights(model)  # from now on an expert read from the checkpoint is all zeros
        procs.append(role("--role", "ffn", "--node-rank", "0"))
        deadline = time.monotonic() + 120
        while metrics()["afd_ffn_ranks_alive"] < 2:
            assert time.monotonic() < deadline, "the replacement did not rejoin"
            assert texts() == expected
        assert texts() == expected
        m = metrics()
        assert m['afd_experts_loaded_total{source="peer"}'] == 8 * LAYERS  # the replacement's, from rank 0
        assert m['afd_experts_loaded_total{source="checkpoint"}'] == 8 * LAYERS  # the recovery's, no more
        placement = httpx.get(url + "/expert_load").json()["placement"]
        assert placement["dead"] == [] and all(len(s) == 16 for s in placement["slot_expert"].values())  # 8 + 8 again
