"""--enable-ffn-fault-tolerance: an AFD deployment loses an FFN rank (SIGKILL) in the middle of
decoding under load, and every request still completes with the greedy tokens of the single
engine (itself checked against transformers); the deployment goes on serving new requests.

Where every expert of the lost rank has a copy on a survivor, the copies take over and the
checkpoint is not read: the test removes its weights once the deployment is up. Where some have
none, survivors give up spare copies' slots and read the lost experts from the checkpoint. (Where
the spare copies do not suffice, survivors grow: tests/distributed/test_elastic_experts.py.)
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
from afd_engine.errors import ConfigError
from tests.engine_helpers import run_staggered, staggered_reference
from tests.process_helpers import free_port, launched_roles, proc_title, wait_healthy
from tests.server.test_engine_death import children

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
LENGTHS = [5, 9, 17, 3, 12, 7, 21, 4]
FT = dict(mode="afd", enable_ffn_fault_tolerance=True, num_threads=1, comm_timeout=5, dispatch_dtype="fp32")

# name: (flags, FFN rank killed, experts read from the checkpoint by the recovery (3 MoE layers))
DEPLOYMENTS = {
    # 16 experts + 16 copies on 2 ranks: each holds every expert; rank 0 is sender 0's relay
    "1A 1x2, every expert copied, the relay killed": (
        dict(dp_size=1, ffn_ranks_per_node=2, ep_num_redundant_experts=16),
        0,
        0,
    ),
    # 16 + 8 slots on 4 ranks of 6: rank 1 holds experts no survivor has (2 per layer), and node
    # 1's spare copies give up their slots to them
    "2A 2x2, lost experts read from the checkpoint": (
        dict(dp_size=2, ffn_nodes=2, ffn_ranks_per_node=2, ep_num_redundant_experts=8),
        1,
        6,
    ),
}


@pytest.fixture(scope="module")
def reference(tiny_v3):
    return staggered_reference(tiny_v3, LENGTHS, GREEDY, seed=5)


def ffn_pid(rank: int, ranks_per_node: int) -> int:
    title = f"afd::ffn-{rank // ranks_per_node}-{rank % ranks_per_node}"
    pids = [p for p in children(os.getpid()) if proc_title(p) == title]
    assert len(pids) == 1, f"no single {title} among this process's descendants"
    return pids[0]


def run_with_kill(engine, prompts, victim: int, after_tokens: int, sig=signal.SIGKILL) -> list[list[int]]:
    """Two requests join every other step (prefills among decodes); once `after_tokens` tokens
    have come out (of requests still running, too), FFN rank `victim` gets `sig`."""
    killed = []

    def maybe_kill(finished_tokens: int) -> None:
        if not killed and finished_tokens + sum(len(r["tokens"]) for r in engine._pending.values()) >= after_tokens:
            os.kill(victim, sig)
            killed.append(True)

    outs = run_staggered(engine, prompts, GREEDY, every=2, after_step=maybe_kill)
    assert killed, "the requests finished before the kill"
    return outs


def settled_stats(engine, timeout: float = 10.0):
    """The deployment's counters once no request holds a page (the ranks report twice a second)."""
    deadline = time.monotonic() + timeout
    while True:
        engine.step()
        stats = engine.stats
        if (stats.running == 0 and stats.kv_pages_used == stats.cache_pages) or time.monotonic() > deadline:
            return stats


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_a_killed_ffn_rank_loses_no_request_and_no_token(name, tiny_v3, reference, tmp_path):
    prompts, expected = reference
    flags, victim, experts_read = DEPLOYMENTS[name]
    model = Path(shutil.copytree(tiny_v3, tmp_path / "model"))
    with make_engine(model_path=str(model), **FT, **flags) as engine:
        ranks = flags.get("ffn_nodes", 1) * flags["ffn_ranks_per_node"]
        if experts_read == 0:  # the copies must do: the checkpoint's weights are gone
            for f in model.glob("*.safetensors"):
                f.unlink()
        pid = ffn_pid(victim, flags["ffn_ranks_per_node"])
        outs = run_with_kill(engine, prompts, pid, after_tokens=40)
        assert outs == expected, name
        stats = settled_stats(engine)
        assert (stats.ffn_recoveries, stats.ffn_ranks_alive, stats.ffn_experts_read) == (1, ranks - 1, experts_read)
        # a lost expert has no live copy to come from: the checkpoint, or nothing where copies took over
        assert (stats.experts_loaded_peer, stats.experts_loaded_checkpoint) == (0, experts_read)
        assert stats.running == 0 and stats.kv_pages_used == stats.cache_pages  # no page held by a request
        # the deployment keeps serving: the same prompts again, token for token
        again = engine.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert [o.token_ids for o in again] == expected


@pytest.mark.timeout(180)
def test_an_ffn_rank_silent_for_the_comm_timeout_is_lost_like_a_dead_one(tiny_v3, reference):
    """SIGSTOP: the process is there, but sends nothing (a hung machine, a cut link)."""
    prompts, expected = reference
    with make_engine(model_path=tiny_v3, dp_size=1, ffn_ranks_per_node=2, ep_num_redundant_experts=16, **FT) as engine:
        pid = ffn_pid(1, 2)
        try:
            outs = run_with_kill(engine, prompts, pid, after_tokens=40, sig=signal.SIGSTOP)
            stats = settled_stats(engine)
        finally:
            os.kill(pid, signal.SIGKILL)
        assert outs == expected
        assert (stats.ffn_recoveries, stats.ffn_ranks_alive) == (1, 1)


def test_fault_tolerance_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="--enable-ffn-fault-tolerance=True: masks lost ranks of an AFD or colo"):
        make_engine(mode="single", enable_ffn_fault_tolerance=True)
    with pytest.raises(ConfigError, match="needs the shm or zmq data plane"):
        make_engine(mode="afd", transport="torch", enable_ffn_fault_tolerance=True)


ROLES = (
    "--mode afd --dp-size 1 --ffn-nodes 2 --ffn-ranks-per-node 2 --ep-num-redundant-experts 16 "
    "--enable-ffn-fault-tolerance --comm-timeout 5 --num-threads 1 --served-model-name tiny"
).split()


@pytest.mark.timeout(300)
def test_a_replacement_ffn_role_rejoins_and_the_placement_uses_it_again(tiny_v3, tmp_path):
    """Roles on one machine, two FFN nodes of two ranks; FFN node 1's role is killed (its process
    group: launcher and ranks, a lost machine) and started again with the same command: its two
    replacements link to each other, are admitted, stage the slots of a placement that uses them,
    and serve again; the tokens stay those of the single engine."""
    rdv, port = f"127.0.0.1:{free_port()}", free_port()
    common = ["--dist-init-addr", rdv, "--model-path", tiny_v3, *ROLES]
    with launched_roles(tmp_path, common) as role:
        procs = [role("--role", "ffn", "--node-rank", "0"), role("--role", "ffn", "--node-rank", "1")]
        procs.append(role("--role", "attention", "--port", str(port)))
        url = f"http://127.0.0.1:{port}"
        prompts = ["across machines", "a node is lost", "and comes back"]
        with Engine(model_path=tiny_v3, num_threads=1) as single:
            expected = [
                o.text
                for o in single.generate(
                    prompts=prompts, sampling_params=SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
                )
            ]
        wait_healthy(url, proc=None)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

        def texts() -> list[str]:
            outs = [
                client.completions.create(
                    model="tiny", prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
                )
                for p in prompts
            ]
            return [o.choices[0].text for o in outs]

        def metric(name: str) -> float:
            return next(
                float(line.split()[1])
                for line in httpx.get(url + "/metrics").text.splitlines()
                if line.startswith(name + " ")
            )

        assert texts() == expected
        os.killpg(procs[1].pid, signal.SIGKILL)
        assert texts() == expected  # served by node 0 alone
        assert metric("afd_ffn_ranks_alive") == 2 and httpx.get(url + "/expert_load").json()["placement"]["dead"] == [
            2,
            3,
        ]
        assert httpx.get(url + "/health").status_code == 200  # degraded, not down
        # a second replacement of a node that lost nothing is refused
        extra = role("--role", "ffn", "--node-rank", "0")
        assert extra.wait(timeout=120) != 0
        assert (
            "has recorded no lost rank of FFN node 0: nothing to replace"
            in (tmp_path / "role3.log").read_text()  # extra: the fourth role started
        )
        procs.append(role("--role", "ffn", "--node-rank", "1"))
        deadline = time.monotonic() + 120
        while metric("afd_ffn_ranks_alive") < 4:  # idle: the admission does not wait for traffic
            assert time.monotonic() < deadline, "the replacement did not rejoin"
            time.sleep(0.2)
        assert texts() == expected
        before = httpx.get(url + "/expert_load").json()
        assert before["placement"]["dead"] == [] and before["placement"]["version"] >= 2
        assert texts() == expected
        after = httpx.get(url + "/expert_load").json()
        for rank in (2, 3):  # node 1's ranks take tokens again
            assert after["expert_rank_load"][rank] > before["expert_rank_load"][rank]
        # the replacement is a survivor like any other: now node 0 is lost, and it serves alone
        os.killpg(procs[0].pid, signal.SIGKILL)
        assert texts() == expected
        assert (metric("afd_ffn_ranks_alive"), metric("afd_ffn_recoveries_total")) == (2, 2)
        procs[2].terminate()  # the attention role stops: the FFN role of the replacement ends cleanly
        assert procs[2].wait(timeout=60) == 0 and procs[3].wait(timeout=60) == 0
