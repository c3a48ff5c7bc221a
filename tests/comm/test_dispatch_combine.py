"""Two-stage and direct dispatch/combine against the torch reference, with exact traffic counts."""

from __future__ import annotations

import functools
import time
import uuid

import pytest
import torch

from comm import volume
from comm.attention_side import attention_endpoint
from comm.endpoint import CommConfig
from comm.ffn_side import ExpertBatch, ffn_endpoint
from comm.messages import CommError, CommTimeout, KeyMismatchError, MsgKey
from comm.reference import reference_combine, run_experts
from comm.stats import CommStats
from comm.topology import INTER_NODE, Topology, TopologyError
from comm.transport.inproc import InProcessFabric
from comm.transport.shm_transport import ShmTransport
from comm.wire import WireFormat
from tests.comm.harness import KEY, exact_expert, routing, run_inproc

FP32 = WireFormat(dispatch="fp32", combine="fp32")
TOPOLOGIES = {
    "1 sender, 1 node x 1": (Topology(1, 1, 1, 8), [5], 2),
    "3 senders, 2 nodes x 2": (Topology(3, 2, 2, 8), [7, 0, 3], 3),
    "3 senders, 1 node x 2": (Topology(3, 1, 2, 8), [6, 2, 0], 3),
    "4 senders, 2 nodes x 3": (Topology(4, 2, 3, 12), [6, 9, 1, 4], 4),
    "5 senders, 3 nodes x 2, remapped": (
        Topology(5, 3, 2, 12, expert_map=tuple(reversed(range(12)))),
        [4, 0, 8, 2, 5],
        3,
    ),
}


# every routing case in process; over the shared-memory transport's host twin of the device path
# (ring_medium.py, threads of this process) the random one
MODES = ("two-stage", "direct")
CASES = [(m, n, c, "inproc") for m in MODES for n in TOPOLOGIES for c in ("random", "one-node", "spread")]
CASES += [(m, n, "random", "shm-twin") for m in MODES for n in TOPOLOGIES]


@pytest.mark.parametrize("mode, name, case, transport", CASES)
def test_combine_equals_reference_exactly(mode, name, case, transport, tmp_path):
    topo, tokens, k = TOPOLOGIES[name]
    k = min(k, topo.num_nodes) if case == "spread" else min(k, topo.num_experts // topo.num_nodes)
    xs, ids, ws = routing(topo, tokens, k, seed=len(name), case=case)
    make = None
    if transport == "shm-twin":
        ns, peers = uuid.uuid4().hex[:12], range(topo.num_endpoints)
        kw = {"directory": str(tmp_path), "capacity": 4096, "payload_device": "cpu", "payload_capacity": 1 << 16}
        make = functools.partial(ShmTransport, peers=peers, namespace=ns, **kw)
    outs, _, _ = run_inproc(topo, CommConfig(mode, FP32, timeout=10), xs, ids, ws, transport=make)
    for sender, (out, ref) in enumerate(zip(outs, reference_combine(xs, ids, ws, exact_expert))):
        assert torch.equal(out[0], ref), f"sender {sender}"


@pytest.mark.parametrize("nodes", [1, 2])
def test_every_sender_empty(nodes):
    topo = Topology(3, nodes, 2, 8)
    xs, ids, ws = routing(topo, [0, 0, 0], 2, seed=0)
    for mode in ("two-stage", "direct"):
        outs, _, _ = run_inproc(topo, CommConfig(mode, FP32, timeout=10), xs, ids, ws)
        assert [o[0].shape for o in outs] == [torch.Size([0, 16])] * 3


@pytest.mark.parametrize("mode", ["two-stage", "direct"])
@pytest.mark.parametrize("name", [name for name, (_, tokens, _) in TOPOLOGIES.items() if 0 in tokens])
def test_senders_without_tokens_can_send_nothing(mode, name):
    """Told which senders send, the FFN ranks wait for no message from the others and return them
    nothing: the same results, no traffic from a sender without tokens, nothing left unread."""
    topo, tokens, k = TOPOLOGIES[name]
    xs, ids, ws = routing(topo, tokens, k, seed=7)
    outs, eps, _ = run_inproc(topo, CommConfig(mode, FP32, timeout=10), xs, ids, ws, skip_empty=True)
    for sender, (out, ref) in enumerate(zip(outs, reference_combine(xs, ids, ws, exact_expert))):
        assert torch.equal(out[0], ref), f"sender {sender}"
    idle = [i for i, t in enumerate(tokens) if t == 0]
    assert idle and all(not eps[i].stats.counters for i in idle)
    inboxes = eps[0].transport.fabric.inboxes.values()
    assert sum(len(q) for inbox in inboxes for q in inbox._channels.values()) == 0


def test_a_sender_left_out_must_have_no_tokens_and_some_sender_must_send():
    topo = Topology(2, 1, 1, 4)
    fabric = InProcessFabric()
    x, ids, w = (t[0] for t in routing(topo, [1], 2, seed=1))
    sender = attention_endpoint(topo, 0, fabric.endpoint(0))
    with pytest.raises(CommError, match=r"1 tokens for .*, which no FFN rank expects"):
        sender.dispatch(x, ids, w, KEY, expected=False)
    ffn = ffn_endpoint(topo, 0, fabric.endpoint(2))
    with pytest.raises(CommError, match="no sender sends for"):
        ffn.recv_dispatch(KEY, senders=[])


def test_a_colocated_rank_sends_to_its_peers_before_itself():
    """Its own share is computed by itself anyway: the peers' messages go first."""
    topo = Topology(3, 1, 3, 6, colocated=True)
    fabric = InProcessFabric()
    transport = fabric.endpoint(1)
    sent = []
    send = transport.send
    transport.send = lambda dst, msg: (sent.append(dst), send(dst, msg))
    for ep in (0, 2):
        fabric.endpoint(ep)
    x, ids, w = (t[0] for t in routing(topo, [4], 3, seed=2))
    handle = attention_endpoint(topo, 1, transport, CommConfig("direct", FP32)).dispatch(x, ids, w, KEY)
    assert sent == [0, 2, 1]
    assert [peer for peer, _, _ in handle.routes] == [0, 1, 2]  # combine still adds in rank order


def test_a_colocated_sender_alone_keeps_its_own_share():
    """keep_own: no message to itself (its own FFN endpoint gets none); the peers compute theirs,
    and combine adds them to the share the sender computed itself, giving the exact result."""
    topo = Topology(3, 1, 3, 6, colocated=True)
    fabric = InProcessFabric()
    transports = [fabric.endpoint(ep) for ep in range(3)]
    sent = []
    send = transports[1].send
    transports[1].send = lambda dst, msg: (sent.append(dst), send(dst, msg))
    x, ids, w = (t[0] for t in routing(topo, [6], 3, seed=4))
    config = CommConfig("direct", FP32, timeout=10)
    sender = attention_endpoint(topo, 1, transports[1], config)
    own = ffn_endpoint(topo, 1, transports[1], config)
    handle = sender.dispatch(x, ids, w, KEY, keep_own=True)
    assert sent == [0, 2] and [peer for peer, _, _ in handle.routes] == [0, 2]
    for rank in (0, 2):
        ffn = ffn_endpoint(topo, rank, transports[rank], config)
        batch = ffn.recv_dispatch(KEY, senders=[1])
        ffn.send_combine(batch, run_experts(batch, topo.experts_of(rank), exact_expert))
    kept = ExpertBatch(KEY, x, own.to_local(ids), w, [])
    partial = run_experts(kept, topo.experts_of(1), exact_expert)
    assert partial.abs().sum() > 0  # the sender's own experts have a share of these tokens
    assert torch.equal(sender.combine(handle, partial), reference_combine([x], [ids], [w], exact_expert)[0])
    assert fabric.inboxes[1].pending(1, "dispatch_direct") == 0


def test_only_a_colocated_direct_sender_keeps_a_share():
    fabric = InProcessFabric()
    x, ids, w = (t[0] for t in routing(Topology(1, 1, 2, 4), [2], 2, seed=5))
    afd = attention_endpoint(Topology(1, 1, 2, 4), 0, fabric.endpoint(0), CommConfig("direct", FP32))
    with pytest.raises(CommError, match="sender 0 holds no experts"):
        afd.dispatch(x, ids, w, KEY, keep_own=True)
    colocated = Topology(2, 1, 2, 4, colocated=True)
    two_stage = attention_endpoint(colocated, 0, fabric.endpoint(5), CommConfig("two-stage", FP32))
    with pytest.raises(CommError, match="two-stage dispatch .* keeps no share"):
        two_stage.dispatch(x, ids, w, KEY, keep_own=True)


def test_colocated_direct_with_several_micro_batches():
    topo = Topology(4, 2, 2, 8, colocated=True)
    xs, ids, ws = routing(topo, [5, 3, 0, 6], 3, seed=3)
    keys = [MsgKey(1, layer, mb) for layer in range(2) for mb in range(2)]
    outs, _, _ = run_inproc(topo, CommConfig("direct", FP32, timeout=10), xs, ids, ws, keys=keys)
    ref = reference_combine(xs, ids, ws, exact_expert)
    assert all(torch.equal(o, ref[i]) for i, per_key in enumerate(outs) for o in per_key)


@pytest.mark.parametrize("dispatch", ["fp32", "fp8"])
@pytest.mark.parametrize("mode", ["two-stage", "direct"])
@pytest.mark.parametrize("colocated", [False, True])
def test_counters_equal_analytic_volumes(dispatch, mode, colocated):
    topo, k = Topology(6 if colocated else 4, 2, 3, 12, colocated=colocated), 4
    xs, ids, ws = routing(topo, [6, 9, 0, 4, 2, 5][: topo.num_senders], k, seed=11, hidden=256)
    wire = WireFormat(dispatch=dispatch, combine="bf16")
    _, eps, _ = run_inproc(topo, CommConfig(mode, wire, timeout=10), xs, ids, ws)
    stats = CommStats.total([e.stats for e in eps])
    per_copy = volume.dispatch_copy_bytes(mode, 256, k, wire, torch.float32)
    for link, n in volume.copies(topo, ids, mode).items():
        assert (stats.get("dispatch", link).messages, stats.get("dispatch", link).bytes) == (n, n * per_copy), link
        assert (stats.get("combine", link).messages, stats.get("combine", link).bytes) == (n, n * 256 * 2), link
    if not colocated:  # every A -> F copy crosses machines; by hand for the simplest figures
        nodes_hit = sum(len(set(topo.node_of_expert[row].tolist())) for row in torch.cat(ids))
        expected = nodes_hit if mode == "two-stage" else torch.cat(ids).numel()
        assert stats.get("dispatch", INTER_NODE).messages == expected
        sends = topo.num_nodes if mode == "two-stage" else topo.num_ffn_ranks
        assert stats.get("dispatch", INTER_NODE).transfers == topo.num_senders * sends


def test_expected_nodes_hit_matches_sampling():
    topo = Topology(1, 2, 8, 256)
    _, ids, _ = routing(topo, [4000], 8, seed=1)
    sampled = sum(len(set(topo.node_of_expert[row].tolist())) for row in ids[0]) / 4000
    assert abs(sampled - volume.expected_nodes_hit(256, 2, 8)) < 0.02
    assert volume.expected_nodes_hit(256, 2, 8) == pytest.approx(2 * (1 - 0.5**8), abs=2e-3)


def test_fp8_dispatch_is_close_and_smaller():
    topo, tokens, k = Topology(3, 2, 2, 8), [5, 7, 2], 3
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(t, 256, generator=g) for t in tokens]
    _, ids, ws = routing(topo, tokens, k, seed=5, hidden=256)
    ref = reference_combine(xs, ids, ws, exact_expert)
    sizes = {}
    for dispatch in ("fp32", "fp8"):
        outs, eps, _ = run_inproc(topo, CommConfig("two-stage", WireFormat(dispatch, "fp32"), timeout=10), xs, ids, ws)
        for o, r in zip(outs, ref):
            rel = ((o[0] - r).norm() / r.norm()).item()
            assert rel < (1e-6 if dispatch == "fp32" else 0.06), f"{dispatch}: relative error {rel}"
        sizes[dispatch] = CommStats.total([e.stats for e in eps]).get("dispatch", INTER_NODE).bytes
    copies = sum(len(set(topo.node_of_expert[r].tolist())) for i in ids for r in i)
    assert sizes["fp32"] - sizes["fp8"] == copies * (256 * 4 - (256 + 4 * 2))


def test_mismatched_key_is_a_clear_error():
    topo = Topology(1, 1, 1, 4)
    xs, ids, ws = routing(topo, [3], 2, seed=0)
    from comm.attention_side import attention_endpoint
    from comm.ffn_side import ffn_endpoint
    from comm.transport.inproc import InProcessFabric

    fabric = InProcessFabric()
    a, f = fabric.endpoint(0), fabric.endpoint(1)
    config = CommConfig("two-stage", FP32, timeout=2)
    attention_endpoint(topo, 0, a, config).dispatch(xs[0], ids[0], ws[0], MsgKey(0, 0, 1))
    ffn = ffn_endpoint(topo, 0, f, config)
    with pytest.raises(
        KeyMismatchError,
        match=r"expected dispatch \(step 0, layer 0, micro-batch 0\).*"
        r"received dispatch \(step 0, layer 0, micro-batch 1\)",
    ):
        ffn.recv_dispatch(KEY)
    ffn.close()


def test_silent_peer_times_out():
    topo = Topology(1, 1, 1, 4)
    from comm.attention_side import attention_endpoint
    from comm.transport.inproc import InProcessFabric

    fabric = InProcessFabric()
    a, _ = fabric.endpoint(0), fabric.endpoint(1)
    sender = attention_endpoint(topo, 0, a, CommConfig("direct", FP32, timeout=0.5))
    xs, ids, ws = routing(topo, [2], 1, seed=0)
    handle = sender.dispatch(xs[0], ids[0], ws[0], KEY)
    with pytest.raises(CommTimeout, match=r"waited 0.5 s for combine_direct \(step 0, layer 0, micro-batch 0\)"):
        sender.combine(handle)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"num_senders": 2, "num_nodes": 2, "ranks_per_node": 3, "num_experts": 8},
            "8 experts do not divide evenly over 6 ranks",
        ),
        (
            {"num_senders": 3, "num_nodes": 2, "ranks_per_node": 2, "num_experts": 8, "colocated": True},
            "one sender per rank",
        ),
        (
            {"num_senders": 1, "num_nodes": 1, "ranks_per_node": 2, "num_experts": 4, "expert_map": (0, 0, 1, 2)},
            "permutation",
        ),
        ({"num_senders": 0, "num_nodes": 1, "ranks_per_node": 1, "num_experts": 4}, "at least one sender"),
    ],
)
def test_invalid_topologies_are_refused(kwargs, message):
    with pytest.raises(TopologyError, match=message):
        Topology(**kwargs)


def test_relay_forwards_one_senders_tokens_before_the_others_arrive():
    import time

    from comm.attention_side import attention_endpoint
    from comm.ffn_side import ffn_endpoint
    from comm.transport.inproc import InProcessFabric

    topo = Topology(3, 1, 2, 4)  # relay rank 0 serves senders 0 and 2; rank 1 owns experts 2, 3
    fabric = InProcessFabric()
    eps = [fabric.endpoint(i) for i in range(topo.num_endpoints)]
    config = CommConfig("two-stage", FP32, timeout=5)
    relay = ffn_endpoint(topo, 0, eps[topo.ffn_endpoint(0)], config)
    x = torch.ones(2, 16)
    ids, ws = torch.tensor([[0, 3], [2, 1]]), torch.ones(2, 2)
    attention_endpoint(topo, 0, eps[0], config).dispatch(x, ids, ws, KEY)
    relay.post_dispatch(KEY)
    inbox = fabric.inboxes[topo.ffn_endpoint(1)]
    deadline = time.monotonic() + 5
    while inbox.pending(topo.ffn_endpoint(0), "forward") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    # sender 2 has not dispatched yet, and rank 1 already holds sender 0's tokens
    assert inbox.pending(topo.ffn_endpoint(0), "forward") == 1
    relay.close()


@pytest.mark.parametrize("mode", ["two-stage", "direct"])
@pytest.mark.parametrize("dead", [{0}, {1}, {0, 3}])
def test_dead_ffn_ranks_are_left_out_and_relays_move_to_live_ranks(mode, dead):
    """Fault tolerance: with FFN ranks masked (their experts routed elsewhere), results stay exact,
    each node's senders relay through its live ranks, and no message reaches a dead rank."""
    topo = Topology(3, 2, 2, 8, dead=frozenset(dead))
    live_experts = torch.tensor([e for e in range(8) if int(topo.ffn_rank_of[e]) not in dead])
    g = torch.Generator().manual_seed(len(dead))
    xs = [torch.randint(-8, 9, (t, 16), generator=g).float() for t in (5, 0, 7)]
    ids = [live_experts[torch.rand(len(x), len(live_experts), generator=g).argsort(dim=1)[:, :2]] for x in xs]
    ws = [torch.randint(1, 5, (len(x), 2), generator=g).float() / 4 for x in xs]
    outs, _, fabric = run_inproc(topo, CommConfig(mode, FP32, timeout=10), xs, ids, ws)
    for sender, (out, ref) in enumerate(zip(outs, reference_combine(xs, ids, ws, exact_expert))):
        assert torch.equal(out[0], ref), f"sender {sender}"
    for rank in dead:
        inbox = fabric.inboxes[topo.ffn_endpoint(rank)]
        sent = {k for k in ("dispatch", "forward", "dispatch_direct") for s in range(7) if inbox.pending(s, k)}
        assert not sent, f"dead rank {rank} was sent {sent}"
    if mode == "two-stage":
        for node in range(2):
            live = topo.live_ranks(node)
            assert [topo.relay_rank(s, node) for s in range(3)] == [live[s % len(live)] for s in range(3)]
            assert sorted(s for r in live for s in topo.senders_of_relay(r)) == [0, 1, 2]


def test_a_node_without_live_ranks_relays_nothing():
    topo = Topology(2, 2, 2, 8, dead=frozenset({2, 3}))
    assert topo.senders_of_relay(2) == [] and topo.relay_rank(1, 0) == 1
    with pytest.raises(TopologyError, match="FFN node 1 has no live rank left to relay sender 0"):
        topo.relay_rank(0, 1)


def test_an_interrupt_gives_a_wait_up_and_the_wait_lasts_twice_the_timeout_without_one():
    topo = Topology(1, 1, 1, 8)
    fabric = InProcessFabric()
    ep = attention_endpoint(topo, 0, fabric.endpoint(0), CommConfig(timeout=0.3))
    fabric.endpoint(1)
    calls = []

    def interrupt():
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("lost")

    ep.interrupt = interrupt
    with pytest.raises(KeyError, match="lost"):
        ep.recv(1, "combine", KEY)
    ep.interrupt = lambda: None
    start = time.monotonic()
    with pytest.raises(
        CommTimeout, match=r"endpoint 0 waited 0.6 s for combine \(step 0, layer 0, micro-batch 0\) from endpoint 1"
    ):
        ep.recv(1, "combine", KEY)
    assert 0.55 < time.monotonic() - start < 2.0
