"""Runs a whole dispatch/combine exchange: one thread (or process) per endpoint."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from comm.attention_side import AttentionEndpoint, attention_endpoint
from comm.endpoint import CommConfig
from comm.ffn_side import FfnEndpoint, ffn_endpoint
from comm.messages import MsgKey
from comm.reference import run_experts
from comm.topology import Topology
from comm.transport.base import Transport
from comm.transport.inproc import InProcessFabric

KEY = MsgKey(0, 0, 0)


def exact_expert(e: int, x: torch.Tensor) -> torch.Tensor:
    """Integer-valued outputs: any summation order gives the same fp32 result."""
    return x * (e + 1) + e


def routing(topo: Topology, tokens: list[int], k: int, seed: int, hidden: int = 16, case: str = "random"):
    """Per sender: hidden [T, H] integer-valued, topk_ids [T, K], weights [T, K] in quarters."""
    g = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for t in tokens:
        xs.append(torch.randint(-8, 9, (t, hidden), generator=g).float())
        ids.append(_pick(topo, t, k, g, case))
        ws.append(torch.randint(1, 5, (t, k), generator=g).float() / 4)
    return xs, ids, ws


def _pick(topo: Topology, t: int, k: int, g, case: str) -> torch.Tensor:
    if case == "one-node":  # every expert of a token on one node
        per_node = [
            [e for e in range(topo.num_experts) if int(topo.node_of_expert[e]) == n] for n in range(topo.num_nodes)
        ]
        rows = []
        for _ in range(t):
            node = per_node[int(torch.randint(topo.num_nodes, (1,), generator=g))]
            rows.append(torch.tensor(node)[torch.randperm(len(node), generator=g)[:k]])
        return torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.int64)
    if case == "spread":  # each expert on a different node (k <= nodes)
        rows = [
            torch.stack([_expert_on(topo, int(n), g) for n in torch.randperm(topo.num_nodes, generator=g)[:k]])
            for _ in range(t)
        ]
        return torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.int64)
    return torch.rand(t, topo.num_experts, generator=g).argsort(dim=1)[:, :k]


def _expert_on(topo: Topology, node: int, g) -> torch.Tensor:
    choices = (topo.node_of_expert == node).nonzero().flatten()
    return choices[torch.randint(len(choices), (1,), generator=g)][0]


def sender_work(ep: AttentionEndpoint, x, ids, w, keys=(KEY,), expected: bool = True) -> list[torch.Tensor]:
    handles = [ep.dispatch(x, ids, w, key, expected) for key in keys]
    return [ep.combine(h) for h in handles]


def ffn_work(ep: FfnEndpoint, keys=(KEY,), expert_fn=exact_expert, senders=None) -> None:
    experts = ep.topo.experts_of(ep.rank)
    for key in keys:
        batch = ep.recv_dispatch(key, senders)
        ep.send_combine(batch, run_experts(batch, experts, expert_fn))


def run_inproc(
    topo: Topology,
    config: CommConfig,
    xs,
    ids,
    ws,
    keys=(KEY,),
    expert_fn=exact_expert,
    skip_empty: bool = False,
    transport: Callable[[int], Transport] | None = None,
):
    """Returns (per sender: list of combine outputs per key, the endpoints, the fabric).
    `skip_empty`: senders without tokens send nothing, and the FFN ranks are told which senders
    send. The topology's dead FFN ranks take no part (routing must leave their experts out).
    `transport(endpoint)`: the endpoints' transports in place of the fabric's (closed at the end)."""
    fabric = InProcessFabric()
    eps = {i: (transport or fabric.endpoint)(i) for i in range(topo.num_endpoints)}
    senders = [attention_endpoint(topo, i, eps[topo.sender_endpoint(i)], config) for i in range(topo.num_senders)]
    live = [r for r in range(topo.num_ffn_ranks) if r not in topo.dead]
    ffn_ranks = [ffn_endpoint(topo, r, eps[topo.ffn_endpoint(r)], config) for r in live]
    results: dict[int, list] = {}
    expected = [len(x) > 0 or not skip_empty for x in xs]
    errors: list[BaseException] = []

    def guard(fn, *args):
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread below
            errors.append(exc)

    def send(i: int) -> None:
        results[i] = sender_work(senders[i], xs[i], ids[i], ws[i], keys, expected[i])

    threads = [threading.Thread(target=guard, args=(send, i)) for i in range(topo.num_senders)]
    active = [i for i, x in enumerate(xs) if len(x)] if skip_empty else None
    threads += [threading.Thread(target=guard, args=(ffn_work, o, keys, expert_fn, active)) for o in ffn_ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=config.timeout * 3)
    for o in ffn_ranks:
        o.close()
    if transport is not None:
        for t in eps.values():
            t.close()
    if errors:
        raise errors[0]
    return [results[i] for i in range(topo.num_senders)], senders + ffn_ranks, fabric
