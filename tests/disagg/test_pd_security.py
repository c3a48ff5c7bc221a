"""The prefill and decode instances' own ports under a stranger: with the cluster secret
(AFD_CLUSTER_SECRET) the KV message and bootstrap ports admit only holders of it; without it,
hostile messages are dropped, pages go only where the request's reservation allows, and both
instances keep serving token-exact. Also the rule that instances on different machines need the
secret."""

from __future__ import annotations

import argparse
import time

import msgpack
import pytest
import zmq

from afd_engine.disagg.bootstrap import BootstrapError, BootstrapQuery
from afd_engine.errors import ConfigError
from comm.auth import ENV, ClusterKeys
from tests.disagg.pd_helpers import idle_pages
from tests.disagg.test_pd_engine import GREEDY, pair

SECRET = "a shared secret of the deployment"
GUESS = ClusterKeys(b"a guessed secret, same length!!!")
REFUSED = "the prefill instance sent pages this rank cannot take"


def hostile_frames(room: int) -> list[list[bytes]]:
    """Messages no prefill rank sends: garbage, msgpack of the wrong type, unknown kinds, rooms
    that are not integers, and too many frames."""
    return [
        [b"\x00\xff garbage"],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({"kind": "pages"})],
        [msgpack.packb({"kind": "bogus", "room": room})],
        [msgpack.packb({"kind": "done", "room": [room]})],
        [msgpack.packb({"kind": "done", "room": True})],
        [msgpack.packb({"kind": "fail", "room": room}), b"x", b"y"],
    ]


def answer(query: BootstrapQuery) -> dict:
    """The bootstrap server's answer, polled as a decode rank polls it (BootstrapError past the timeout)."""
    while (got := query.answer()) is None:
        time.sleep(0.01)
    return got


def stranger(ctx: zmq.Context, address: str, keys: ClusterKeys | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_serverkey = keys.server[0]
        sock.curve_publickey, sock.curve_secretkey = keys.client
    sock.connect(address)
    return sock


def test_without_the_secret_hostile_messages_are_dropped_and_pages_stay_in_their_reservation(tiny_v3):
    pd = pair(tiny_v3, decode={"disaggregation_timeout": 5.0})
    ctx = zmq.Context()
    try:
        (want,) = pd.generate(prompt_token_ids=[[5] * 40], sampling_params=GREEDY)
        rid = pd.add_request(prompt_token_ids=[7] * 40, params=GREEDY, to_prefill=False)  # reserved, never filled
        room = pd.decode._requests[rid].disagg_room
        while room not in pd.decode.disagg.reserved:
            pd.step()
        reserved = sorted(pd.decode._requests[rid].kv_pages)
        sock = stranger(ctx, pd.decode.disagg.address)
        for frames in hostile_frames(room):
            sock.send_multipart(frames)
        to_prefill = stranger(ctx, pd.prefill.disagg.address)
        for frames in hostile_frames(room):
            to_prefill.send_multipart(frames)
        # the right room, but pages outside its reservation: the request fails, nothing is written
        outside = [p for p in range(pd.decode.pool.num_pages) if p not in reserved][:2]
        sock.send_multipart([msgpack.packb({"kind": "pages", "room": room, "pages": outside}), b"\0" * 64])
        (out,) = pd.run_until(lambda: not pd.decode.has_unfinished())
        assert out.request_id == rid and out.finish_reason == "error"
        assert out.error == f"{REFUSED}: pages outside the request's reservation"
        pd.run_until(lambda: pd.decode.disagg.dropped == 7 and pd.prefill.disagg.dropped == 7)
        # its own pages, but not as many bytes as they hold
        rid = pd.add_request(prompt_token_ids=[8] * 40, params=GREEDY, to_prefill=False)
        room = pd.decode._requests[rid].disagg_room
        while room not in pd.decode.disagg.reserved:
            pd.step()
        pages = sorted(pd.decode._requests[rid].kv_pages)
        sock.send_multipart([msgpack.packb({"kind": "pages", "room": room, "pages": pages}), b"\0" * 64])
        (out,) = pd.run_until(lambda: not pd.decode.has_unfinished())
        assert out.error.startswith(f"{REFUSED}: 64 bytes of pages where")
        # both instances go on serving, token-exact
        (again,) = pd.generate(prompt_token_ids=[[5] * 40], sampling_params=GREEDY)
        assert again.token_ids == want.token_ids and again.error is None
        pd.run_until(lambda: not pd.prefill.has_unfinished())
        assert idle_pages(pd.prefill) and idle_pages(pd.decode)
    finally:
        ctx.destroy(linger=0)
        pd.close()


def test_with_the_secret_strangers_are_refused_at_the_handshake(tiny_v3, monkeypatch):
    with pytest.MonkeyPatch.context() as plain:  # the reference, from a pair without the secret
        plain.delenv(ENV, raising=False)
        ref = pair(tiny_v3)
        try:
            want = [o.token_ids for o in ref.generate(prompt_token_ids=[[5] * 40, [6] * 20], sampling_params=GREEDY)]
        finally:
            ref.close()
    monkeypatch.setenv(ENV, SECRET)
    pd = pair(tiny_v3)
    ctx = zmq.Context()
    try:
        assert pd.decode.disagg.keys is not None and pd.prefill.disagg.keys is not None
        for keys in (None, GUESS):
            for address in (pd.decode.disagg.address, pd.prefill.disagg.address):
                sock = stranger(ctx, address, keys)
                for frames in hostile_frames(1 << 20):
                    sock.send_multipart(frames)
        # the bootstrap server answers holders of the secret only
        with pytest.raises(BootstrapError, match=r"did not answer within 0.3 s \(this instance has a cluster secret"):
            answer(BootstrapQuery(ctx, pd.address, timeout_ms=300, keys=GUESS))
        with pytest.raises(BootstrapError, match=r"did not answer within 0.3 s$"):
            answer(BootstrapQuery(ctx, pd.address, timeout_ms=300))
        outs = pd.generate(prompt_token_ids=[[5] * 40, [6] * 20], sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == want and all(o.error is None for o in outs)
        assert pd.decode.disagg.transfer_bytes > 0
        assert pd.decode.disagg.dropped == 0 and pd.prefill.disagg.dropped == 0  # nothing got through to drop
    finally:
        ctx.destroy(linger=0)
        pd.close()


def secret_flags(mode: str, host: str, backend: str = "builtin", secret=None, insecure=False):
    ns = argparse.Namespace(cluster_secret=secret, insecure_cluster=insecure)
    args = argparse.Namespace(
        disaggregation_mode=mode, disaggregation_host=host, disaggregation_transfer_backend=backend
    )
    return ns, args


def test_instances_on_different_machines_need_the_secret(monkeypatch):
    from afd_engine.cli import _pd_secret

    # set first, so that monkeypatch restores its absence after _pd_secret has set it below (a
    # secret left in this worker's environment would reach every later test's processes)
    monkeypatch.setenv(ENV, "unset after the test")
    monkeypatch.delenv(ENV)
    _pd_secret(*secret_flags("decode", "127.0.0.1"))  # one machine: optional
    _pd_secret(*secret_flags("null", "10.0.0.2"))  # not disaggregated: nothing to guard
    with pytest.raises(ConfigError, match="--disaggregation-host 10.0.0.2 is reached over the network"):
        _pd_secret(*secret_flags("decode", "10.0.0.2"))
    _pd_secret(*secret_flags("prefill", "10.0.0.1", insecure=True))
    with pytest.raises(ConfigError, match="mooncake between machines is not authenticated"):
        _pd_secret(*secret_flags("prefill", "10.0.0.1", "mooncake", secret=SECRET))
    with pytest.raises(ConfigError, match="--cluster-secret: the cluster secret must have at least 16"):
        _pd_secret(*secret_flags("prefill", "10.0.0.1", secret="short"))
    _pd_secret(*secret_flags("prefill", "10.0.0.1", secret=SECRET))
    import os

    assert os.environ[ENV] == SECRET  # for this instance's processes


def test_serve_pd_hands_the_secret_to_its_instances_in_their_environment():
    from afd_engine.server.pd_serve import instance_argv, instance_env

    argv = ["--cluster-secret", SECRET, "--num-threads", "1"]
    assert SECRET not in instance_argv(argv, "single", "decode", 1234, "", None)
    assert instance_env((), SECRET)[ENV] == SECRET
