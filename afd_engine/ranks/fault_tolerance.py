"""Fault tolerance (--enable-fault-tolerance): what both sides of an AFD deployment share.

An FFN rank holds only experts, which have copies on other ranks or sit in the checkpoint, so the
deployment can go on without it. The attention ranks watch their FFN ranks' heartbeats
(fault_tolerance_liveness.py); once one is lost, they agree on a placement without it (survivors
may grow to more slots than they had, within their caps: eplb/elastic.py), and every surviving FFN
rank loads its part of it (a recovery); a replacement started later is admitted as an EPLB
rebalance is switched (fault_tolerance_recovery.py), and copies its experts from live ranks of its
node where they hold them (eplb/peer_copy.py). An attention rank whose process exits is dropped
alike: the survivors agree on it in a round, their recovery plan names it among `dead_senders`,
and from then on the FFN ranks wait for nothing from it (the front end resumes its requests on the
survivors: control/failover.py). This module is their vocabulary: the
errors, the messages and their keys, and how long each side waits for the other.

    kind       from -> to                        key: (step, layer, micro-batch)     meta
    heartbeat  FFN rank -> attention ranks       (count, HEARTBEAT_LAYER, 0)         pid, space, incarnation, cap
    recover    attention rank -> live FFN ranks  (recovery count, RECOVER_LAYER, 0)  placement, served one, next step,
                                                                                     dead senders
    recovered  FFN rank -> attention ranks       (recovery count, RECOVER_LAYER, 0)  experts read, copied; or an error
    join       attention rank -> replacement     (incarnation, JOIN_LAYER, 0)        placement, served one,
                                                                                     recoveries, joiners, dead senders
    start      attention rank -> replacement     (incarnation, JOIN_LAYER, 1)        first step, keepalive ids; or void

The pseudo-layers are allotted with the others in comm/protocol.py.
"""

from __future__ import annotations

import json

from comm.messages import CommError, MsgKey
from comm.protocol import HEARTBEAT_LAYER, JOIN_LAYER, RECOVER_LAYER
from comm.protocol import HEARTBEAT_S as HEARTBEAT_S  # how often an FFN rank sends one: part of this vocabulary

HEARTBEAT, RECOVER, RECOVERED, JOIN, START = "heartbeat", "recover", "recovered", "join", "start"
READMIT = "readmit"  # the step descriptor's field naming replacements the FFN ranks of their node link to


# -- errors ------------------------------------------------------------------------------------


class PeerLostError(CommError):
    """An attention rank went silent without shutting down."""


class DescriptorMismatchError(CommError):
    """The attention ranks' step descriptors (or recovery plans) do not describe the same thing."""


class FfnRankLost(CommError):
    """FFN ranks sent no heartbeat for --comm-timeout, or attention ranks (`attention`: their
    endpoints) exited (fault tolerance: a recovery follows)."""

    def __init__(self, ranks: list[int], message: str, attention: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks, self.attention = ranks, attention or []


class StepAborted(CommError):
    """The attention ranks started a recovery: the step under way is given up (it runs again)."""


class RecoveryFailed(CommError):
    """A recovery or an admission could not be done; the message says why. An attention rank
    raises it when the deployment cannot go on without its lost FFN ranks, an FFN rank when it
    could not take its part (having told the attention ranks, which then fail fast with why)."""


# -- message keys ------------------------------------------------------------------------------


def heartbeat_key(count: int) -> MsgKey:
    return MsgKey(count, HEARTBEAT_LAYER, 0)


def recover_key(recovery: int) -> MsgKey:
    """The key of a recovery's plan and answers: every rank counts its recoveries alike."""
    return MsgKey(recovery, RECOVER_LAYER, 0)


def join_key(incarnation: int) -> MsgKey:
    """The admission of a replacement: keyed by its incarnation, so a void one's messages differ."""
    return MsgKey(incarnation, JOIN_LAYER, 0)


def start_key(incarnation: int) -> MsgKey:
    return MsgKey(incarnation, JOIN_LAYER, 1)


# -- how long each side waits (each wait covers what the other side may spend first) ------------


def round_wait(args, ft: bool) -> float:
    """An attention rank's wait for its peers in an agreement round: with fault tolerance a peer
    may first sit out a lost rank's timeout and a recovery."""
    return args.comm_timeout * 2 + args.ffn_recovery_timeout if ft else args.comm_timeout


def silence_limit(args, ft: bool) -> float:
    """How long an attention rank may send its FFN ranks nothing: --comm-timeout, and with fault
    tolerance also the time it may spend noticing a lost FFN rank and recovering."""
    return args.comm_timeout * 3 + args.ffn_recovery_timeout if ft else args.comm_timeout


def recovery_deadline(args) -> float:
    """How long the survivors of a recovery, or replacements being admitted, may take to load
    their experts."""
    return args.ffn_recovery_timeout + args.comm_timeout


def recover_wait(args) -> float:
    """An FFN rank's wait for every attention rank's recovery plan, once one has called it."""
    return args.ffn_recovery_timeout + 2 * args.comm_timeout


def join_wait(args) -> float:
    """A replacement's wait for its admission: the deployment notices it between steps."""
    return args.ffn_recovery_timeout + 3 * args.comm_timeout + 60


# -- shared bookkeeping ------------------------------------------------------------------------


def ffn_rank(topo, endpoint: int) -> int:
    """The FFN rank at an FFN endpoint (AFD)."""
    return endpoint - topo.num_senders


def live_ffn_endpoints(topo, dead: frozenset[int]) -> list[int]:
    """The endpoints of the FFN ranks not in `dead`, in rank order."""
    return [topo.ffn_endpoint(r) for r in range(topo.num_ffn_ranks) if r not in dead]


def readmit(transport, store, endpoint: int, incarnation: int) -> None:
    """Links to the process of `incarnation` at `endpoint`, found at the rendezvous."""
    transport.readmit(endpoint, *store.peer(endpoint), incarnation)


def from_live_senders(transport, senders: list[int], kind: str, key, wait: float, on_first) -> dict[int, dict]:
    """The metas of one message (`kind`, `key`) from every live attention rank: the first to come
    names the lost ones (`on_first(meta)` takes them into account and returns the senders left),
    then each of the others'. Sender endpoint -> meta."""
    first = transport.recv_any(senders, kind, key, wait)
    views = {first.src: first.meta}
    for ep in on_first(first.meta):
        if ep != first.src:
            views[ep] = transport.recv(ep, kind, key, wait).meta
    return views


def agreed(views: dict[int, dict], what: str) -> dict:
    """The one view every attention rank sent (DescriptorMismatchError naming `what` otherwise)."""
    if len({json.dumps(v, sort_keys=True) for v in views.values()}) > 1:
        raise DescriptorMismatchError(what)
    return next(iter(views.values()))
