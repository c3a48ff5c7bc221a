"""An F (expert) rank: headless, stateless; serves its experts for every attention rank, step by step.

Between steps it waits for every attention rank's descriptor, counting the keepalives idle
attention ranks send: an attention rank heard from once and then silent for `--comm-timeout`
seconds has died without shutting down (killed, machine lost), and the expert rank stops with
PeerLostError instead of waiting forever.

Per step it checks every attention rank's descriptor (same step id, else KeyMismatchError), then
runs, for each MoE layer and micro-batch, receive -> experts -> combine. The stages follow the
seed's F-side layout: per layer [post receive] [wait + mlp] [combine] plus N-2 empty stages, rows
staggered by one (delays 0..N-1), so the receive of micro-batch m+1 is posted (relaying starts in
the background) before the combine of m, and never holds that combine back.
"""

from __future__ import annotations

import logging
import time

import torch

from afd_engine.distributed.attention_runner import KEEPALIVE_LAYER, STEP_LAYER
from afd_engine.distributed.spec import DeploymentSpec
from afd_engine.distributed.timeline import Timeline, pause
from afd_engine.operations import YieldOperation, run_micro_batches
from comm.ffn_side import FfnEndpoint
from comm.messages import CommError, CommTimeout, MsgKey
from comm.transport.base import Transport
from kernels.moe import fused_moe

log = logging.getLogger("afd.ffn")
LIVENESS_CHECK_S = 1.0  # how often a waiting expert rank checks that its attention ranks are alive


class PeerLostError(CommError):
    """An attention rank went silent without shutting down."""


class FfnWorker:
    def __init__(self, shard, spec: DeploymentSpec, rank: int, transport: Transport) -> None:
        self.shard, self.spec, self.rank, self.transport = shard, spec, rank, transport
        topo = spec.topology
        self.owner = FfnEndpoint(topo, rank, transport, spec.comm_config())
        self.senders = [topo.sender_endpoint(i) for i in range(topo.num_senders)]
        self.n = spec.args.num_micro_batches
        self.step_id = 0
        self.heard = {ep: None for ep in self.senders}  # monotonic time of each sender's last message
        self.keepalives = {ep: 0 for ep in self.senders}  # next keepalive id expected from each sender
        self.timeline = Timeline(spec.args.record_timeline, "f", rank)
        self.ops = self._operations()

    def run(self) -> None:
        while self._next_step():
            with torch.inference_mode():
                run_micro_batches(self.ops, [{} for _ in range(self.n)], delays=list(range(self.n)))
            self.timeline.end_step(self.step_id)
            self.step_id += 1
        self.owner.close()

    def _next_step(self) -> bool:
        """Waits for every attention rank's descriptor of the next step; False on shutdown."""
        key = MsgKey(self.step_id, STEP_LAYER, 0)
        descriptors = [self._descriptor(ep, key) for ep in self.senders]
        return not any(d.meta["shutdown"] for d in descriptors)

    def _descriptor(self, ep: int, key: MsgKey):
        """The step descriptor from attention endpoint ep, however long an idle deployment takes;
        PeerLostError once ep, heard from before, has been silent past the comm timeout."""
        while True:
            try:
                msg = self.transport.recv(ep, "step", key, LIVENESS_CHECK_S)
            except CommTimeout:
                self._take_keepalives(ep)
                silent = time.monotonic() - self.heard[ep] if self.heard[ep] is not None else 0.0
                if silent > self.spec.args.comm_timeout:
                    raise PeerLostError(
                        f"attention endpoint {ep} sent no step and no keepalive for {silent:.0f} s "
                        f"(--comm-timeout {self.spec.args.comm_timeout:g}): it stopped without shutting down "
                        f"(killed, or its machine is gone); expert rank {self.rank} stops") from None
                continue
            self._take_keepalives(ep)  # the ones sent before this descriptor: none stay queued
            self.heard[ep] = time.monotonic()
            return msg

    def _take_keepalives(self, ep: int) -> None:
        while True:
            try:
                self.transport.recv(ep, "keepalive", MsgKey(self.keepalives[ep], KEEPALIVE_LAYER, 0), 0.0)
            except CommTimeout:
                return
            self.keepalives[ep] += 1
            self.heard[ep] = time.monotonic()

    def _operations(self) -> list:
        ops = []
        for layer_id in self.spec.moe_layers:
            ops += [self._recv(layer_id), YieldOperation(), self._mlp(layer_id), YieldOperation(),
                    self._send(layer_id)] + [YieldOperation()] * max(self.n - 1, 1)
        return ops

    def _recv(self, layer_id: int):
        def post_recv(st) -> None:  # posts the receive (relaying starts); never blocks
            self.owner.post_dispatch(MsgKey(self.step_id, layer_id, st.micro_batch))
        return post_recv

    def _mlp(self, layer_id: int):
        experts = self.shard.experts(layer_id)

        def mlp(st) -> None:  # the MLP waits for its dispatch, then computes
            with self.timeline.span("recv", st.micro_batch, layer_id):
                batch = self.owner.recv_dispatch(MsgKey(self.step_id, layer_id, st.micro_batch))
            st.set("batch", batch)
            with self.timeline.span("ffn", st.micro_batch, layer_id, tokens=batch.hidden.shape[0]):
                st.set("y", fused_moe(batch.hidden, experts.w13, experts.w2, batch.local_ids, batch.weights))
                pause(self.spec.args.inject_ffn_delay_ms)
        return mlp

    def _send(self, layer_id: int):
        def combine(st) -> None:
            self.owner.send_combine(st.pop("batch"), st.pop("y"))
        return combine
