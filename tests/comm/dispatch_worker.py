"""Process body for the cross-process dispatch/combine test: one OS process per endpoint."""

from __future__ import annotations

import traceback

import torch

from comm.attention_side import attention_endpoint
from comm.endpoint import CommConfig
from comm.ffn_side import ffn_endpoint
from comm.topology import Topology
from comm.transport.factory import make_transport
from tests.comm.harness import ffn_work, sender_work


def run_endpoint(
    topo: Topology, config: CommConfig, endpoint: int, transport: tuple[str, dict], inputs, keys, results
) -> None:
    """transport: (kind, keyword arguments but the endpoint) for make_transport. inputs: per sender
    (hidden, topk_ids, weights). Senders report their combine outputs."""
    torch.set_num_threads(1)
    kind, kwargs = transport
    transport = make_transport(kind, endpoint, **kwargs)
    try:
        out = None
        is_sender = endpoint < topo.num_senders
        if topo.colocated or not is_sender:
            rank = endpoint if topo.colocated else endpoint - topo.num_senders
            ffn = ffn_endpoint(topo, rank, transport, config)
        if is_sender:
            sender = attention_endpoint(topo, endpoint, transport, config)
            handles = [sender.dispatch(*inputs[endpoint], key) for key in keys]
        if topo.colocated or not is_sender:
            ffn_work(ffn, keys)
            ffn.close()
        if is_sender:
            # plain lists: tensors through a multiprocessing queue travel as shared-memory handles
            # that die with this process
            out = [sender.combine(h).tolist() for h in handles]
        stats = (ffn if not is_sender else sender).stats.as_dict()
        results.put(("ok", endpoint, out, stats))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put(("error", endpoint, traceback.format_exc() + _state(transport), None))
    finally:
        transport.close()


def _state(transport) -> str:
    """What a shared-memory endpoint holds when it fails: unread bytes per incoming ring, the
    messages waiting in its inbox per channel, whether a thread is pumping and who waits."""
    readers = getattr(transport, "_readers", None)
    if readers is None:
        return ""
    inbox = transport._inbox
    rings = {r.ring.path.rsplit("-", 1)[-1]: (r.ring.readable(), r._view is not None) for r in readers}
    queued = {f"{src}/{kind}": [str(m.key) for _, m in q] for (src, kind), q in inbox._channels.items() if q}
    waiting = [(sorted(w.channels), w.pumps) for w in inbox._waiters]
    return (
        f"rings (unread bytes, mid-frame): {rings}\nqueued: {queued}\npumping: {inbox._pumping}\nwaiters: {waiting}\n"
    )


__all__ = ["run_endpoint", "sender_work"]
