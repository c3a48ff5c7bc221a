"""Dispatch/combine between attention ranks and FFN ranks (two-stage and direct).

Usable without the rest of the engine; see the README section "Dispatch/combine library".
"""

from comm.attention_side import AttentionEndpoint, DispatchHandle, attention_endpoint
from comm.endpoint import CommConfig
from comm.ffn_side import ExpertBatch, FfnEndpoint, ffn_endpoint
from comm.messages import CommError, CommTimeout, KeyMismatchError, MsgKey
from comm.topology import Topology, TopologyError
from comm.wire import WireFormat

__all__ = [
    "AttentionEndpoint",
    "CommConfig",
    "CommError",
    "CommTimeout",
    "DispatchHandle",
    "ExpertBatch",
    "FfnEndpoint",
    "KeyMismatchError",
    "MsgKey",
    "Topology",
    "TopologyError",
    "WireFormat",
    "attention_endpoint",
    "ffn_endpoint",
]
