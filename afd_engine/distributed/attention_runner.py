"""An attention rank's step: N micro-batches through the layers, MoE layers through dispatch/combine.

The forward of one micro-batch is one flat list of operations; `YieldOperation` sits between a
MoE layer's dispatch and its combine, so the stage that starts with combine(l) runs on through
the attention of layer l+1 to its dispatch (a cross-layer stage):

    [embed, dense layers, attn(l) + gate + dispatch(l) + shared(l)] | [combine(l), attn(l+1) ...] | ...

The executor runs the stages column by column over the micro-batches, so while micro-batch m's
tokens are at the experts, the others compute attention. In colocated mode the rank also serves
its own experts for every rank, inside the same stage, before waiting for its combine.

Lockstep: before each step the attention ranks exchange their token counts, and a rank with no
work still steps (with empty micro-batches) while any rank has work, so the expert side gets a
message from every rank for every layer and micro-batch.
"""

from __future__ import annotations

import time

import torch

from afd_engine.distributed.spec import DeploymentSpec
from afd_engine.distributed.timeline import Timeline, pause
from afd_engine.operations import YieldOperation, run_micro_batches, split_micro_batches
from afd_engine.runtime.forward_batch import ForwardBatch
from afd_engine.runtime.kv_cache import KVPool
from afd_engine.runtime.model_runner import ModelRunner, StepInputs, commit, logit_rows
from afd_engine.runtime.scheduler import StepPlan
from comm.attention_side import AttentionEndpoint
from comm.ffn_side import FfnEndpoint
from comm.messages import Message, MsgKey
from comm.transport.base import Transport
from kernels.moe import fused_moe

SYNC_LAYER, STEP_LAYER = -2, -1  # pseudo-layers of the lockstep exchange and the step descriptor
KEEPALIVE_LAYER = -3  # pseudo-layer of the keepalive an idle attention rank sends its expert ranks
KEEPALIVE_S = 1.0  # an attention rank that has sent its expert ranks nothing for this long sends a keepalive


class PipelineRunner(ModelRunner):
    lockstep = True

    def __init__(self, model, pool: KVPool, spec: DeploymentSpec, rank: int, transport: Transport) -> None:
        super().__init__(model, pool)
        self.spec, self.rank, self.transport = spec, rank, transport
        topo, config = spec.topology, spec.comm_config()
        self.sender = AttentionEndpoint(topo, rank, transport, config)
        self.owner = FfnEndpoint(topo, rank, transport, config) if topo.colocated else None
        self.peers = [topo.sender_endpoint(i) for i in range(topo.num_senders) if i != rank]
        self.ffn = [] if topo.colocated else [topo.owner_endpoint(r) for r in range(topo.num_owners)]
        self.n = spec.args.num_micro_batches
        self.step_id = self.sync_id = self.keepalive_id = 0
        self.last_ffn_send = float("-inf")  # monotonic time of the last message to the expert ranks
        self.want_stop = self.stopped = False  # shutdown is agreed in a lockstep round, like a step
        self.timeline = Timeline(spec.args.record_timeline, "a", rank)
        self.ops = self._operations()

    # -- lockstep --------------------------------------------------------------------------

    def begin_step(self, plan: StepPlan) -> bool:
        """True when any attention rank has work this step (every rank calls this every round)."""
        self._keepalive()
        mine = sum(n for _, n in plan.extend) + len(plan.decode)
        key = MsgKey(self.sync_id, SYNC_LAYER, 0)
        for peer in self.peers:
            self.transport.send(peer, Message("sync", key, self.sender.endpoint,
                                              meta={"tokens": mine, "stop": self.want_stop}))
        metas = [self.sender.recv(p, "sync", key).meta for p in self.peers]
        self.sync_id += 1
        self.stopped = self.want_stop or any(m["stop"] for m in metas)
        return not self.stopped and mine + sum(m["tokens"] for m in metas) > 0

    # -- one step --------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, plan: StepPlan):
        inputs = StepInputs.of(plan)
        seqs = inputs.extend + inputs.decode
        groups = split_micro_batches([len(c.tokens) for c in seqs], self.n)
        micro = [self._micro_batch(inputs, g) for g in groups]
        self._announce([int(m["fb"].num_tokens) for m in micro])
        outs = run_micro_batches(self.ops, micro, delays=[0] * self.n)
        commit(plan)
        self.timeline.end_step(self.step_id)
        self.step_id += 1
        return inputs.samplers, torch.cat(outs) if outs else torch.empty(0)

    def _micro_batch(self, inputs: StepInputs, group: range) -> dict:
        n_ext = len(inputs.extend)
        ext = [inputs.extend[i] for i in group if i < n_ext]
        dec = [inputs.decode[i - n_ext] for i in group if i >= n_ext]
        fb = ForwardBatch.build(ext, dec, self.pool.page_table, self.pool.page_size)
        return {"fb": fb, "rows": logit_rows(ext + dec, [inputs.samples[i] for i in group])}

    def _announce(self, tokens: list[int], shutdown: bool = False) -> None:
        """The step descriptor every expert rank checks before serving the step."""
        key = MsgKey(self.step_id, STEP_LAYER, 0)
        for ep in self.ffn:
            self.transport.send(ep, Message("step", key, self.sender.endpoint,
                                            meta={"tokens": tokens, "shutdown": shutdown}))
        self.last_ffn_send = time.monotonic()

    def _keepalive(self) -> None:
        """While idle, tells the expert ranks every KEEPALIVE_S that this rank is alive: an expert
        rank on another machine cannot otherwise tell a quiet deployment from a dead one."""
        if not self.ffn or time.monotonic() - self.last_ffn_send < KEEPALIVE_S:
            return
        key = MsgKey(self.keepalive_id, KEEPALIVE_LAYER, 0)
        for ep in self.ffn:
            self.transport.send(ep, Message("keepalive", key, self.sender.endpoint))
        self.keepalive_id += 1
        self.last_ffn_send = time.monotonic()

    def close(self) -> None:
        self._announce([], shutdown=True)
        if self.owner is not None:
            self.owner.close()

    # -- the operations of one micro-batch -------------------------------------------------

    def _key(self, layer: int, st) -> MsgKey:
        return MsgKey(self.step_id, layer, st.micro_batch)

    def _operations(self) -> list:
        model = self.model
        ops = [self._embed]
        for layer in model.model.layers:
            if not layer.is_moe:
                ops.append(self._dense(layer))
                continue
            ops += [self._dispatch(layer), YieldOperation()]
            if self.owner is not None:
                ops.append(self._serve_experts(layer.layer_id))
            ops.append(self._combine(layer.layer_id))
        return ops + [self._logits]

    def _embed(self, st) -> None:
        x, cos_sin = self.model.embed(st.get("fb"))
        st.set("x", x)
        st.set("cos_sin", cos_sin)

    def _dense(self, layer):
        def dense(st) -> None:
            st.set("x", layer(st.pop("x"), st.get("fb"), st.get("cos_sin"), self.pool.cache[layer.layer_id]))
        return dense

    def _dispatch(self, layer):
        mlp = layer.mlp

        def attention_gate_dispatch(st) -> None:
            x_in = st.pop("x")  # [tokens, hidden]
            with self.timeline.span("attention", st.micro_batch, layer.layer_id, tokens=x_in.shape[0]):
                x, h = layer.attention_part(x_in, st.get("fb"), st.get("cos_sin"),
                                            self.pool.cache[layer.layer_id])
                topk_ids, topk_weights = mlp.gate(h)
                pause(self.spec.args.inject_attention_delay_ms)
            st.set("handle", self.sender.dispatch(h, topk_ids, topk_weights, self._key(layer.layer_id, st)))
            st.set("shared", mlp.shared_experts(h) if mlp.shared_experts is not None else None)
            st.set("residual", x)
        return attention_gate_dispatch

    def _serve_experts(self, layer_id: int):
        experts = self.model.model.layers[layer_id].mlp.experts

        def serve_experts(st) -> None:
            batch = self.owner.recv_dispatch(self._key(layer_id, st))
            y = fused_moe(batch.hidden, experts.w13, experts.w2, batch.local_ids, batch.weights)
            self.owner.send_combine(batch, y)
        return serve_experts

    def _combine(self, layer_id: int):
        def combine(st) -> None:
            with self.timeline.span("wait", st.micro_batch, layer_id):
                routed = self.sender.combine(st.pop("handle"))
            shared = st.pop("shared")
            st.set("x", st.pop("residual") + (routed if shared is None else routed + shared))
        return combine

    def _logits(self, st) -> None:
        st.pop("fb")
        st.pop("cos_sin")
        st.set_output(self.model.logits(st.pop("x"), st.pop("rows")))
