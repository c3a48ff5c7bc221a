"""The A <-> FFN data-plane protocol in one place: message kinds, pseudo-layer ids, each kind's
tensors as named fields, and the one table of dtype names.

Every message is keyed (step, layer, micro-batch). Real layers are >= 0; the lockstep and
liveness messages use negative pseudo-layers so they can never collide with a layer's data.

    kind             from -> to                         tensors (in order)
    dispatch         sender -> relay (two-stage)        hidden scales ids weights rows
    forward          relay -> FFN rank in its node      hidden scales ids weights rows
    expert_out       FFN rank -> relay                  out
    combine          relay -> sender                    out
    dispatch_direct  sender -> FFN rank (direct)        hidden scales ids rows
    combine_direct   FFN rank -> sender                 out
    sync             attention rank -> attention ranks  (meta: tokens, stop, eplb_*; loads when planning)
    step             attention rank -> FFN ranks        (meta: tokens per micro-batch, shutdown, eplb_*)
    keepalive        idle attention rank -> FFN ranks   -
    eplb_ready       FFN rank -> attention ranks        (key step = placement version; see afd_engine/eplb)
    heartbeat        FFN rank -> attention ranks        - (with --enable-ffn-fault-tolerance, every HEARTBEAT_S)
    recover          attention rank -> FFN ranks        (meta: placement without the lost ranks, next step id)
    recovered        FFN rank -> attention ranks        (meta: experts copied from peers and read from the checkpoint,
                                                         or an error)
    expert_want      FFN rank -> FFN rank of its node   - (key: placement version, layer, expert; eplb/peer_copy.py)
    expert_copy      FFN rank -> FFN rank of its node   the slot's weight tensors (w13 w2, or FP8 bytes and scales)
    join             attention rank -> replacement      (meta: the placement that uses it)
    start            attention rank -> replacement      (meta: the step it first serves, keepalive ids)

hidden [n, H] (fp32/bf16, or fp8 values with scales [n, H/128] fp32; scales is [n, 0] otherwise),
ids [n, K] int32 (-1: another node's or rank's slot; direct: [n] one expert per copy),
weights [n, K] fp32, rows [n] int32 (the token's row at its sender), out [n, H] in the combine dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from comm.messages import CommError, Message, MsgKey

SYNC_LAYER, STEP_LAYER, KEEPALIVE_LAYER = -2, -1, -3  # pseudo-layers of the lockstep and liveness messages
EPLB_LAYER = -4  # pseudo-layer of rebalancing messages
HEARTBEAT_LAYER, RECOVER_LAYER = -5, -6  # pseudo-layers of FFN fault tolerance (key step: count, recovery)
JOIN_LAYER = -7  # a replacement FFN rank's admission (key step: its incarnation; micro-batch 0 join, 1 start)
HEARTBEAT_S = 0.5  # how often an FFN rank of a fault-tolerant deployment says it is alive
# the kinds of a step's messages: an aborted step's are dropped when it runs again under a new id
STEP_KINDS = ("step", "dispatch", "forward", "expert_out", "combine", "dispatch_direct", "combine_direct")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # wire names of activation dtypes


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of an activation dtype (the inverse of DTYPES)."""
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise CommError(f"activations in {dtype} cannot travel; use one of {', '.join(map(str, DTYPES.values()))}")


@dataclass(frozen=True)
class Layout:
    """The tensors of one message kind, by name and in order."""

    kind: str
    fields: tuple[str, ...]

    def pack(self, key: MsgKey, src: int, meta: dict | None = None, **tensors: torch.Tensor) -> Message:
        if set(tensors) != set(self.fields):
            raise CommError(f"a {self.kind} message carries {list(self.fields)}, got {sorted(tensors)}")
        return Message(self.kind, key, src, [tensors[f] for f in self.fields], dict(meta or {}))

    def unpack(self, msg: Message) -> dict[str, torch.Tensor]:
        if msg.kind != self.kind or len(msg.tensors) != len(self.fields):
            raise CommError(
                f"expected a {self.kind} message with {len(self.fields)} tensors, got {msg.kind} "
                f"with {len(msg.tensors)}"
            )
        return dict(zip(self.fields, msg.tensors))


DISPATCH = Layout("dispatch", ("hidden", "scales", "ids", "weights", "rows"))
FORWARD = Layout("forward", DISPATCH.fields)
EXPERT_OUT = Layout("expert_out", ("out",))
COMBINE = Layout("combine", ("out",))
DISPATCH_DIRECT = Layout("dispatch_direct", ("hidden", "scales", "ids", "rows"))
COMBINE_DIRECT = Layout("combine_direct", ("out",))
