"""`afd launch` by role: an attention role and FFN roles as separate commands, meeting at a rendezvous."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from afd_engine import Engine, SamplingParams
from tests.process_helpers import afd_start as afd
from tests.process_helpers import free_port, stopped_after, wait_healthy

TOPO = (
    "--mode afd --dp-size 2 --ffn-nodes 2 --ffn-ranks-per-node 1 --micro-batches 2 --served-model-name tiny "
    "--num-threads 1"
).split()


def one_by_one(rdv: str, model: str, *extra: str) -> list[str]:
    """Flags of a deployment of one attention rank and one FFN rank that meet at `rdv`."""
    topology = "--mode afd --dp-size 1 --ffn-nodes 1 --ffn-ranks-per-node 1 --num-threads 1".split()
    return ["--dist-init-addr", rdv, "--model-path", model, *topology, *extra]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["auto", "torch"])
def test_roles_started_in_any_order_serve_together(tiny_v3, transport):
    rdv, port = f"127.0.0.1:{free_port()}", free_port()
    common = ["--dist-init-addr", rdv, "--model-path", tiny_v3, *TOPO, "--transport", transport]
    procs = [afd("launch", "--role", "ffn", "--node-rank", "1", *common)]
    time.sleep(2)  # an FFN node first, the attention role later, the last FFN node last
    procs.append(afd("launch", "--role", "attention", "--port", str(port), *common))
    time.sleep(2)
    procs.append(afd("launch", "--role", "ffn", "--node-rank", "0", *common))
    with stopped_after(procs):
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(
            model="tiny", prompt="across machines", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        with Engine(model_path=tiny_v3, num_threads=1) as single:
            ref = single.generate(
                prompts=["across machines"],
                sampling_params=SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True),
            )
        assert out.choices[0].text == ref[0].text
        procs[1].terminate()  # the attention role stops: the FFN roles are told and exit cleanly
        assert procs[1].wait(timeout=60) == 0
        assert procs[0].wait(timeout=60) == 0 and procs[2].wait(timeout=60) == 0


def alone(rdv: str, model: str, *role: str) -> tuple[int, str]:
    """One role started with a 3 s rendezvous timeout and no peer ever coming: (exit status, output)."""
    proc = afd("launch", *role, "--dist-init-addr", rdv, "--rendezvous-timeout", "3", "--model-path", model, *TOPO)
    out, _ = proc.communicate(timeout=90)
    return proc.returncode, out


@pytest.mark.timeout(120)
def test_missing_peers_time_out_with_a_clear_message(tiny_v3):
    rdv = f"127.0.0.1:{free_port()}"
    returncode, out = alone(rdv, tiny_v3, "--role", "ffn", "--node-rank", "0")
    assert returncode != 0
    assert f"got no answer from the rendezvous at {rdv} within 3 s" in out


@pytest.mark.timeout(300)
def test_ffn_role_stops_when_the_attention_machine_vanishes(tiny_v3):
    """kill -9 of the whole attention role (as if its machine were lost): the FFN role, told nothing,
    notices the silence within --comm-timeout and exits 1; while the attention role idles, its
    keepalives keep the FFN role waiting."""
    rdv, port = f"127.0.0.1:{free_port()}", free_port()
    common = one_by_one(rdv, tiny_v3, "--comm-timeout", "4")
    ffn = afd("launch", "--role", "ffn", "--node-rank", "0", *common)
    attention = afd("launch", "--role", "attention", "--port", str(port), *common, new_session=True)
    with stopped_after([ffn, attention]):
        wait_healthy(f"http://127.0.0.1:{port}")
        time.sleep(8)  # idle for twice the timeout: keepalives, no steps
        assert ffn.poll() is None, ffn.stdout.read()
        os.killpg(attention.pid, signal.SIGKILL)  # the server and its attention ranks, no shutdown message
        start = time.monotonic()
        out, _ = ffn.communicate(timeout=60)
        assert ffn.returncode == 1
        assert time.monotonic() - start < 4 + 15
        assert "sent no step and no keepalive for" in out and "stopped without shutting down" in out
        assert "Traceback" not in out


@pytest.mark.timeout(120)
def test_attention_role_alone_names_the_missing_ranks(tiny_v3):
    """The rendezvous is up (the attention role hosts it) but no FFN role comes: the attention
    ranks give up after the timeout and say which endpoints never registered."""
    rdv, port = f"127.0.0.1:{free_port()}", free_port()
    returncode, out = alone(rdv, tiny_v3, "--role", "attention", "--port", str(port))
    assert returncode == 2, out
    assert f"only 2 of 4 ranks registered at {rdv} within 3 s (missing endpoints: [2, 3])" in out


@pytest.mark.timeout(180)
def test_an_ffn_role_with_fewer_micro_batches_refuses_the_first_step(tiny_v3):
    """An attention role started with more --micro-batches than the FFN role: the FFN role checks
    the first step's descriptors, says what differs and exits 1 instead of serving garbage or
    hanging. (Fewer is served: an FFN rank runs the micro-batches each descriptor lists.)"""
    rdv, port = f"127.0.0.1:{free_port()}", free_port()
    common = one_by_one(rdv, tiny_v3, "--comm-timeout", "5", "--served-model-name", "tiny")
    ffn = afd("launch", "--role", "ffn", "--node-rank", "0", *common, "--micro-batches", "2")
    attention = afd(
        "launch", "--role", "attention", "--port", str(port), *common, "--micro-batches", "3", new_session=True
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        with pytest.raises(openai.APIError):
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60).completions.create(
                model="tiny", prompt=["hello", "good morning", "one two three", "the cat"], max_tokens=2
            )  # four prompts in one step: the lone attention rank splits them into 3 micro-batches
        out, _ = ffn.communicate(timeout=60)
        assert ffn.returncode == 1
        assert "expected 1 to 2 token counts (one per micro-batch)" in out and "same --micro-batches" in out
        assert "Traceback" not in out
    finally:
        for p in (ffn, attention):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if p is attention else p.kill()
