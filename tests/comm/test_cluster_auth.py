"""The cluster secret between machines: ZeroMQ CURVE keys derived from it on the data plane (a peer
without it, or with another secret, is refused at the handshake and counted; nothing it sends
arrives), HMAC signatures on rendezvous entries, and the rule that a deployment across machines
needs the secret."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import zmq

from comm.auth import ClusterKeys, cluster_keys, is_loopback
from comm.messages import Message, MsgKey
from comm.transport.zmq_transport import ZmqTransport, free_tcp_addresses

KEYS = ClusterKeys(b"a shared secret of the deployment")


def message(i: int) -> Message:
    return Message("dispatch", MsgKey(1, i, 0), 1, [torch.full((4,), float(i))])


def wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_keys_are_derived_the_same_everywhere_and_hidden():
    again = ClusterKeys(b"a shared secret of the deployment")
    assert KEYS.server == again.server and KEYS.client == again.client and KEYS.server != KEYS.client
    assert KEYS.server != ClusterKeys(b"another secret, same length....").server
    assert "secret" not in repr(KEYS) and b"shared" not in repr(KEYS).encode()
    signed = KEYS.sign("tcp://10.0.0.2:5555")
    assert KEYS.verify(signed) == "tcp://10.0.0.2:5555"
    assert ClusterKeys(b"another secret, same length....").verify(signed) is None
    assert KEYS.verify("tcp://10.0.0.2:5555") is None and KEYS.verify(signed[:-1] + "0") in (None,)


def test_peers_with_the_secret_talk_and_strangers_are_refused():
    addrs = dict(enumerate(free_tcp_addresses(3)))
    receiver = ZmqTransport(0, addrs, keys=KEYS)
    friend = ZmqTransport(1, addrs, keys=KEYS)
    impostor = ZmqTransport(2, addrs, keys=ClusterKeys(b"a guessed secret, same length!!!"))
    ctx = zmq.Context()
    plain = ctx.socket(zmq.PUSH)  # no CURVE at all
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(addrs[0])
    leaked = ctx.socket(zmq.PUSH)  # knows the server's public key, but not the deployment's client key
    leaked.setsockopt(zmq.LINGER, 0)
    leaked.curve_serverkey = KEYS.server[0]
    leaked.curve_publickey, leaked.curve_secretkey = zmq.curve_keypair()
    leaked.connect(addrs[0])
    try:
        for i in range(5):
            # without blocking: once the receiver has refused their handshake, ZeroMQ may hold no pipe
            # for these sockets, and a blocking send would wait for one forever
            for sock, first in ((plain, 100), (leaked, 300)):
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart([bytes(f) for f in message(first + i).encode()], flags=zmq.NOBLOCK)
            impostor.send(0, message(200 + i))
            friend.send(0, message(i))
        for i in range(5):
            got = receiver.recv(1, "dispatch", MsgKey(1, i, 0), timeout=10)
            assert torch.equal(got.tensors[0], torch.full((4,), float(i)))
        wait_for(lambda: receiver.refused >= 3)  # the plain socket, the impostor and the leaked key
        time.sleep(0.3)
        # nothing of theirs arrived: neither as messages nor as malformed bytes
        assert receiver.dropped == 0
        assert receiver._inbox.pending(2, "dispatch") == 0 and receiver._inbox.pending(1, "dispatch") == 0
    finally:
        plain.close(0)
        leaked.close(0)
        ctx.term()
        for t in (receiver, friend, impostor):
            t.close()


def test_the_secret_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("AFD_CLUSTER_SECRET", raising=False)
    assert cluster_keys(None) is None
    assert cluster_keys("0123456789abcdef").secret == b"0123456789abcdef"
    monkeypatch.setenv("AFD_CLUSTER_SECRET", "from the environment!")
    assert cluster_keys(None).secret == b"from the environment!"
    with pytest.raises(ValueError, match="at least 16 characters"):
        cluster_keys("short")


@pytest.mark.parametrize(
    "address, loopback",
    [
        ("127.0.0.1:5000", True),
        ("127.0.0.2:5000", True),
        ("localhost:80", True),
        ("[::1]:5000", True),
        ("10.0.0.1:5000", False),
        ("192.168.1.20:29500", False),
    ],
)
def test_loopback_addresses(address, loopback):
    assert is_loopback(address) is loopback
