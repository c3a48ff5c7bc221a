"""Time of one dispatch and one combine: bytes per link (from the same copy counts as `comm/`),
over per-GPU NIC and scale-up bandwidth at the hardware's goodput, plus a fixed latency.

Two layouts:

* bipartite (AFD): S attention GPUs send to F GPUs on their own nodes. Every copy crosses the
  scale-out network. Direct mode sends one copy per selected expert (DeepEP low-latency style);
  two-stage sends one copy per FFN node hit, to the relay GPU `i mod R`, which forwards over the
  scale-up network to the FFN ranks while more tokens arrive (streamed, so the two stages
  overlap and the slower one sets the time).
* symmetric (colocated EP): every GPU sends to and receives from every other; copies to GPUs on the
  sender's node go over the scale-up network, the rest over the NIC.

The time is the busiest link's bytes / goodput: the sender's NIC, the receiver's NIC, or the scale-up
link. With more attention senders than F receivers the receivers' NICs are the busiest.

`imbalance` (max over mean token load of the expert ranks) scales what reaches the busiest rank:
its NIC in direct mode and colocated EP, and its scale-up link (the last hop of two-stage, and
colocated copies from its own node). It does not scale the relays' NICs in two-stage mode: relay
`i mod R` takes every copy for its node from sender i, whichever rank owns the expert, so those NICs
carry the node's load, whose imbalance a rank-level figure does not give (it is at most that figure).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from afd_engine.errors import ConfigError
from afd_engine.planner.expert_load import check_imbalance
from afd_engine.planner.hardware import Hardware

DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp32": 4}
META_BYTES = 8  # expert id / weight / token row sent with each copy (see comm/volume.py)


def scale_bytes(hidden: int, dtype: str) -> int:
    """fp8 carries one fp32 scale per 128 values (comm/wire.py)."""
    return 4 * -(-hidden // 128) if dtype == "fp8" else 0


def copy_bytes(hidden: int, dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"wire dtype {dtype!r} must be one of {', '.join(DTYPE_BYTES)}")
    return hidden * DTYPE_BYTES[dtype] + scale_bytes(hidden, dtype) + META_BYTES


def expected_distinct(groups: int, experts: int, topk: int) -> float:
    """E[distinct groups hit] when top-k of `experts` (spread evenly over `groups`) are drawn uniformly."""
    per_group = experts // groups
    if experts - per_group < topk:
        return float(groups)
    return groups * (1 - comb(experts - per_group, topk) / comb(experts, topk))


@dataclass(frozen=True)
class CommTime:
    """Microseconds of one dispatch and one combine, and the bytes behind them (per busiest GPU)."""

    dispatch_us: float
    combine_us: float
    sender_nic_us: float  # dispatch + combine on one sender's NIC alone
    receiver_nic_us: float  # dispatch + combine on one receiver's NIC alone
    scaleup_us: float  # dispatch + combine on the scale-up link alone
    inter_node_bytes: int  # dispatch, whole deployment, between nodes
    copies_per_token: float  # over the scale-out network (direct: top-k; two-stage: FFN nodes hit)
    latency_us: float = 0.0  # part of each phase that delays but does not occupy the link

    @property
    def dispatch_busy_us(self) -> float:
        """How long one dispatch keeps its links busy (what limits back-to-back micro-batches)."""
        return self.dispatch_us - self.latency_us

    @property
    def combine_busy_us(self) -> float:
        return self.combine_us - self.latency_us

    @property
    def total_us(self) -> float:
        return self.dispatch_us + self.combine_us

    def as_dict(self) -> dict:
        return {
            "dispatch_us": self.dispatch_us,
            "combine_us": self.combine_us,
            "total_us": self.total_us,
            "sender_nic_us": self.sender_nic_us,
            "receiver_nic_us": self.receiver_nic_us,
            "scaleup_us": self.scaleup_us,
            "inter_node_bytes": self.inter_node_bytes,
            "copies_per_token": self.copies_per_token,
        }


@dataclass(frozen=True)
class CommCase:
    tokens: int  # per sending GPU
    hidden: int
    topk: int
    experts: int
    senders: int  # attention GPUs (bipartite) or EP size (symmetric)
    receivers: int  # F GPUs (bipartite) or EP size (symmetric)
    mode: str = "two-stage"  # direct | two-stage
    dispatch_dtype: str = "fp8"
    combine_dtype: str = "bf16"
    symmetric: bool = False  # colocated EP: senders are the receivers
    imbalance: float = 1.0  # max / mean token load of the receivers (expert ranks)


def comm_time(case: CommCase, hw: Hardware, receiver_hw: Hardware | None = None) -> CommTime:
    if case.mode not in ("direct", "two-stage"):
        raise ConfigError(f"dispatch mode {case.mode!r} must be 'direct' or 'two-stage'")
    if case.tokens < 0 or min(case.hidden, case.topk, case.experts, case.senders, case.receivers) < 1:
        raise ConfigError("tokens must be >= 0; hidden, topk, experts, senders and receivers >= 1")
    k = check_imbalance(case.imbalance, "CommCase.imbalance")  # into the busiest receiver, over the mean's
    rhw = receiver_hw or hw
    eff, reff = hw.efficiency, rhw.efficiency
    d_bytes, c_bytes = copy_bytes(case.hidden, case.dispatch_dtype), copy_bytes(case.hidden, case.combine_dtype)
    nic_s = hw.nic_gbs_per_gpu * eff.nic * 1e3  # bytes per microsecond
    nic_r = rhw.nic_gbs_per_gpu * reff.nic * 1e3
    su_r = rhw.scaleup_gbs * reff.scaleup * 1e3
    t = case.tokens
    if case.symmetric:
        per_node = min(hw.gpus_per_node, case.senders)
        remote_share = 1 - per_node / case.senders  # copies leaving the node
        net = t * case.topk * remote_share
        local = t * case.topk * (per_node - 1) / case.senders
        s_d, s_c = net * d_bytes / nic_s, net * c_bytes / nic_s
        r_d, r_c = k * s_d, k * s_c
        u_d, u_c = k * local * d_bytes / su_r, k * local * c_bytes / su_r
        copies, inter = case.topk * remote_share, round(net * d_bytes * case.senders)
    else:
        f_nodes = max(1, case.receivers // rhw.gpus_per_node)
        per_node = case.receivers // f_nodes
        copies = case.topk if case.mode == "direct" else expected_distinct(f_nodes, case.experts, case.topk)
        net = t * copies  # copies leaving one sender
        inbound = net * case.senders / case.receivers  # copies arriving at one F GPU, on average
        s_d, s_c = net * d_bytes / nic_s, net * c_bytes / nic_s
        if case.mode == "direct":  # every copy lands on its expert's rank
            inbound *= k
        r_d, r_c = inbound * d_bytes / nic_r, inbound * c_bytes / nic_r
        if case.mode == "two-stage":  # relay -> FFN ranks inside the node, minus the relay's own experts
            owners_per_node_hit = expected_distinct(case.receivers, case.experts, case.topk) / copies
            forwarded = k * inbound * owners_per_node_hit * (1 - 1 / per_node)  # into the busiest rank
            u_d, u_c = forwarded * d_bytes / su_r, forwarded * c_bytes / su_r
        else:
            u_d = u_c = 0.0
        inter = round(net * d_bytes * case.senders)
    lat = eff.comm_latency_us if t else 0.0
    dispatch = lat + max(s_d, r_d, u_d)
    combine = lat + max(s_c, r_c, u_c)
    return CommTime(dispatch, combine, s_d + s_c, r_d + r_c, u_d + u_c, inter, copies, lat)
