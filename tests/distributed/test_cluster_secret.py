"""`afd launch` with the cluster secret: roles that share it serve over CURVE-authenticated ZeroMQ;
a peer without it is refused at the data plane (1,000 hostile frames while the deployment serves,
tokens exact, no rank exits) and at the rendezvous; across machines the secret is required."""

from __future__ import annotations

import random
import socket
import threading
import time
from datetime import timedelta

import openai
import pytest
import zmq

from afd_engine import Engine, SamplingParams
from comm.auth import ClusterKeys
from tests.comm.test_hostile_frames import hostile_frames
from tests.distributed.test_launch_roles import one_by_one
from tests.process_helpers import afd_start as afd
from tests.process_helpers import free_port, wait_healthy

SECRET = "correct horse battery staple"
ENV = {"AFD_CLUSTER_SECRET": SECRET}
PROMPTS = ["across machines", "with a secret"]


def store_entry(rdv: str, key: str) -> str:
    from torch.distributed import TCPStore

    host, port = rdv.rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    return store.get(key).decode()


def attack(address: str, rdv: str, ctx: zmq.Context) -> None:
    """1,000 hostile frames from a ZeroMQ peer at a rank's data-plane address, and raw bytes at that
    port and at the rendezvous."""
    stranger = ctx.socket(zmq.PUSH)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(address)
    rng = random.Random(0)
    for frames in hostile_frames(rng, 1000):
        try:
            stranger.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:  # (with the secret: no pipe while its handshake is failing)
            pass
    host, data_port = address.removeprefix("tcp://").rsplit(":", 1)
    rdv_host, rdv_port = rdv.rsplit(":", 1)
    for i in range(40):
        target = (host, int(data_port)) if i % 2 else (rdv_host, int(rdv_port))
        with socket.create_connection(target, timeout=5) as raw:
            raw.sendall(rng.randbytes(rng.randrange(1, 512)))
    stranger.close(0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("secret", [True, False], ids=["secret", "no-secret"])
def test_a_stranger_attacking_while_the_deployment_serves(tiny_v3, secret):
    """With the secret the stranger is refused at the handshake and nothing of it reaches a rank;
    without it its frames reach the rank's parser and are dropped. Either way every request is
    token-exact and no rank exits."""
    rdv, port = f"127.0.0.1:{free_port()}", free_port()
    common = one_by_one(rdv, tiny_v3, "--transport", "zmq", "--served-model-name", "tiny")
    env = ENV if secret else {}
    ffn = afd("launch", "--role", "ffn", "--node-rank", "0", *common, env=env)
    attention = afd("launch", "--role", "attention", "--port", str(port), *common, env=env)
    ctx = zmq.Context()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc=attention)
        entry = store_entry(rdv, "afd/endpoint/1")  # the FFN rank's data-plane address
        address = ClusterKeys(SECRET.encode()).verify(entry) if secret else entry
        assert address is not None and address.startswith("tcp://127.0.0.1:")
        with Engine(model_path=tiny_v3, num_threads=1) as single:
            ref = single.generate(
                prompts=PROMPTS, sampling_params=SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
            )
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        attacker = threading.Thread(target=attack, args=(address, rdv, ctx))
        attacker.start()
        while attacker.is_alive():  # requests all through the attack
            out = client.completions.create(
                model="tiny", prompt=PROMPTS, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            assert [c.text for c in out.choices] == [r.text for r in ref]
        attacker.join()
        assert ffn.poll() is None and attention.poll() is None
        attention.terminate()
        assert attention.wait(timeout=60) == 0 and ffn.wait(timeout=60) == 0
        log = ffn.stdout.read()
        if secret:
            assert "refused a connection without the cluster secret" in log, log[-3000:]
            assert "malformed" not in log  # none of the stranger's frames reached the rank's parser
            assert SECRET not in log + attention.stdout.read()
        else:
            assert "malformed message" in log, log[-3000:]  # reached the parser, dropped
    finally:
        ctx.destroy(linger=0)
        for p in (ffn, attention):
            if p.poll() is None:
                p.kill()


@pytest.mark.timeout(120)
def test_an_unsigned_rendezvous_entry_is_refused(tiny_v3):
    """A peer without the secret registers as the FFN rank: the attention rank refuses the entry
    and the role exits saying why, instead of sending activations to it."""
    from torch.distributed import TCPStore

    rdv, port = f"127.0.0.1:{free_port()}", free_port()
    common = one_by_one(rdv, tiny_v3, "--rendezvous-timeout", "30")
    attention = afd("launch", "--role", "attention", "--port", str(port), *common, env=ENV)
    try:
        host, rdv_port = rdv.rsplit(":", 1)
        deadline = time.monotonic() + 60
        while True:  # the attention role hosts the store: wait until it is up
            try:
                store = TCPStore(host, int(rdv_port), is_master=False, timeout=timedelta(seconds=2))
                break
            except (RuntimeError, OSError):
                assert time.monotonic() < deadline and attention.poll() is None
        store.set("afd/host/1", "")
        store.set("afd/endpoint/1", "tcp://127.0.0.1:1")
        out, _ = attention.communicate(timeout=90)
        assert attention.returncode == 2, out[-3000:]
        assert "the rendezvous entry afd/endpoint/1 is not signed with this deployment's cluster secret" in out
    finally:
        if attention.poll() is None:
            attention.kill()


@pytest.mark.parametrize(
    "extra, words",
    [
        ((), "is reached over the network: give every role the same secret in AFD_CLUSTER_SECRET"),
        (
            ("--cluster-secret", SECRET, "--transport", "torch"),
            "--transport torch between machines is not authenticated",
        ),
        (("--cluster-secret", "short"), "--cluster-secret: the cluster secret must have at least 16 characters"),
    ],
)
def test_across_machines_the_secret_is_required(tiny_v3, extra, words):
    proc = afd("launch", "--role", "ffn", *one_by_one("10.255.255.1:29500", tiny_v3, *extra))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and words in out, out[-2000:]
