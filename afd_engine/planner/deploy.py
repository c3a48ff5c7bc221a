"""One deployment's decode step: stage times -> the N-micro-batch pipeline -> TPOT, throughput and
memory per GPU.

The pipeline, per MoE layer (A: attention stage on the attention GPU; D and C: dispatch and combine;
F: routed experts), with N micro-batches in flight:

    AFD        period P = max(N*A, N*D', N*F, N*C', A + D + F + C)
    colocated  period P = max(N*(A + F), N*(D' + C'), A + D + F + C)

(D', C': the time a phase occupies its links, D and C less the fixed latency, which delays one
micro-batch but does not hold up the next.)

AFD runs A and F on different GPUs and dispatch and combine on opposite directions of the links,
so each is its own resource; a colocated GPU computes both A and F, and its NIC carries both
phases in each direction. The last term is one micro-batch's round trip: with too few micro-batches
it is what sets the period (a bubble). Over L MoE layers a step takes (L-1)*P + (N-1)*A' + round
trip, plus the dense layers (attention GPU only), the lm_head and a fixed per-step cost.

Speculative decoding with the MTP module (`mtp_steps` N drafts per request and step, `accept_length`
A tokens kept per step on average) changes both sides: a verify step runs every request as 1 + N
decode rows through every layer (so the FFN side gets 1 + N times the tokens per step), the
module then makes one pass of one MoE layer over the same rows and N - 1 chained passes over one
row per request, and each step emits A tokens per request: TPOT = step / A, throughput x A.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from afd_engine.errors import ConfigError
from afd_engine.planner.network import CommCase, comm_time
from afd_engine.planner.stages import StageModel

MEMORY_RESERVE = 0.08  # of each GPU's memory kept for activations, workspace and fragmentation
GB = 1e9


@dataclass(frozen=True)
class Deployment:
    mode: str  # "afd" or "colocated"
    attn_gpus: int  # AFD: attention GPUs (DP size); colocated: all GPUs (DP = EP size)
    ffn_gpus: int  # AFD: expert GPUs (EP size); colocated: 0
    micro_batches: int
    seqs_per_gpu: int  # running sequences per attention GPU, over all its micro-batches
    dispatch: str = "two-stage"  # AFD only; colocated always sends directly
    shared_expert: str = "attention"  # AFD: which side runs the shared expert (Baidu: attention; Step-3: ffn)
    mtp_steps: int = 0  # speculative decoding: drafts per request and step (0: off)
    accept_length: float = 1.0  # speculative decoding: tokens kept per request and step (accepted drafts + 1)

    @property
    def gpus(self) -> int:
        return self.attn_gpus + self.ffn_gpus

    def validate(self) -> None:
        if self.mode not in ("afd", "colocated"):
            raise ConfigError(f"--mode {self.mode!r} must be 'afd' or 'colocated'")
        if self.attn_gpus < 1 or self.micro_batches < 1 or self.seqs_per_gpu < 0:
            raise ConfigError("attention GPUs and micro-batches must be >= 1, sequences >= 0")
        if self.shared_expert not in ("attention", "ffn") or (
            self.mode == "colocated" and self.shared_expert != "attention"
        ):
            raise ConfigError(f"shared expert placement {self.shared_expert!r} must be 'attention' or (AFD only) 'ffn'")
        if self.mode == "afd" and self.ffn_gpus < 1:
            raise ConfigError("an AFD deployment needs at least one FFN GPU")
        if self.mtp_steps < 0 or not 1.0 <= self.accept_length <= self.mtp_steps + 1:
            raise ConfigError(
                f"the accepted length {self.accept_length} must be between 1 and drafts + 1 ({self.mtp_steps + 1})"
            )


@dataclass(frozen=True)
class Estimate:
    deployment: Deployment
    tpot_ms: float
    tokens_per_gpu_s: float
    tokens_per_s: float
    attention_us: float  # one micro-batch, one MoE layer
    ffn_us: float
    dispatch_us: float
    combine_us: float
    period_us: float  # one MoE layer, all micro-batches
    attention_busy: float  # fraction of the MoE period the attention GPU computes
    ffn_busy: float
    bound: str  # the term that sets the period
    attn_gpu_gb: float  # memory used per attention (or colocated) GPU
    ffn_gpu_gb: float
    fits: bool
    step_ms: float = 0.0  # one decode step (with speculation: verify and draft passes)
    ffn_tokens_per_layer: float = 0.0  # tokens the FFN side computes per MoE layer and step, all micro-batches

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "deployment"}
        return {"deployment": asdict(self.deployment), **out}


def pipeline_period(
    n: int, attention: float, ffn: float, dispatch_busy: float, combine_busy: float, round_trip: float, afd: bool = True
) -> tuple[float, str]:
    """Period of one MoE layer with n micro-batches, and the term that sets it (formula above)."""
    if afd:
        terms = {"attention": n * attention, "dispatch": n * dispatch_busy, "ffn": n * ffn, "combine": n * combine_busy}
    else:
        terms = {"compute": n * (attention + ffn), "network": n * (dispatch_busy + combine_busy)}
    terms["round trip"] = round_trip
    bound = max(terms, key=terms.get)
    return terms[bound], bound


def moe_layers_time(layers: int, n: int, period: float, a_work: float, round_trip: float) -> float:
    """L MoE layers of n micro-batches: L-1 periods, then the last layer's n stages and round trip."""
    return (layers - 1) * period + (n - 1) * a_work + round_trip if layers else 0.0


@dataclass(frozen=True)
class _Layer:
    """One MoE layer's stage times for `rows` token rows per micro-batch."""

    attention: float
    ffn: float
    dispatch: float
    combine: float
    period: float
    bound: str
    a_work: float
    round_trip: float


def _moe_layer(sm: StageModel, dep: Deployment, rows: float) -> _Layer:
    m, n = sm.model, dep.micro_batches
    afd = dep.mode == "afd"
    ep = dep.ffn_gpus if afd else dep.attn_gpus
    shared_on_f = dep.shared_expert == "ffn"
    t_a = sm.attention_us(rows, shared_expert=not shared_on_f)
    t_f = sm.experts_us(rows * dep.attn_gpus, ep, hw=sm.ffn_hw if afd else sm.attn_hw, shared_expert=shared_on_f)
    case = CommCase(
        tokens=round(rows),
        hidden=m.hidden,
        topk=m.topk,
        experts=m.experts,
        senders=dep.attn_gpus,
        receivers=ep,
        mode=dep.dispatch if afd else "direct",
        symmetric=not afd,
        imbalance=sm.expert_imbalance,
    )
    comm = comm_time(case, sm.attn_hw, sm.ffn_hw if afd else None)
    round_trip = t_a + comm.dispatch_us + t_f + comm.combine_us
    period, bound = pipeline_period(n, t_a, t_f, comm.dispatch_busy_us, comm.combine_busy_us, round_trip, afd)
    return _Layer(t_a, t_f, comm.dispatch_us, comm.combine_us, period, bound, t_a if afd else t_a + t_f, round_trip)


def estimate(sm: StageModel, dep: Deployment) -> Estimate:
    dep.validate()
    m, n = sm.model, dep.micro_batches
    afd = dep.mode == "afd"
    rows_per_seq = 1 + dep.mtp_steps  # a verify step's decode rows per request
    b = dep.seqs_per_gpu / n
    layer = _moe_layer(sm, dep, b * rows_per_seq)
    moe_us = moe_layers_time(m.moe_layers, n, layer.period, layer.a_work, layer.round_trip)
    step_us = (
        sm.attn_hw.efficiency.step_overhead_us
        + sm.head_us(dep.seqs_per_gpu * rows_per_seq)
        + m.dense_layers * n * sm.dense_layer_us(b * rows_per_seq)
        + moe_us
    )
    if dep.mtp_steps:  # the module's passes: one MoE layer each, and its head
        for rows in [b * rows_per_seq] + [b] * (dep.mtp_steps - 1):
            mtp = _moe_layer(sm, dep, rows)
            step_us += moe_layers_time(1, n, mtp.period, mtp.a_work, mtp.round_trip) + sm.head_us(rows * n)
    tokens_per_s = dep.seqs_per_gpu * dep.attn_gpus * dep.accept_length / (step_us * 1e-6) if dep.seqs_per_gpu else 0.0
    attn_gb, ffn_gb = memory_gb(sm, dep)
    fits = attn_gb <= sm.attn_hw.mem_gb * (1 - MEMORY_RESERVE) and (
        not afd or ffn_gb <= sm.ffn_hw.mem_gb * (1 - MEMORY_RESERVE)
    )
    return Estimate(
        dep,
        step_us / 1e3 / dep.accept_length,
        tokens_per_s / dep.gpus,
        tokens_per_s,
        layer.attention,
        layer.ffn,
        layer.dispatch,
        layer.combine,
        layer.period,
        n * layer.a_work / layer.period if layer.period else 0.0,
        n * layer.ffn / layer.period if layer.period else 0.0,
        layer.bound,
        attn_gb,
        ffn_gb,
        fits,
        step_us / 1e3,
        dep.seqs_per_gpu * dep.attn_gpus * rows_per_seq,
    )


def memory_gb(sm: StageModel, dep: Deployment) -> tuple[float, float]:
    """Bytes per attention GPU (weights + KV) and per FFN GPU (its experts), in GB."""
    kv = dep.seqs_per_gpu * sm.kv_bytes_per_seq()
    if dep.mode == "afd":
        shared_on_f = dep.shared_expert == "ffn"
        return (
            (sm.attention_weight_bytes(shared_expert=not shared_on_f) + kv) / GB,
            sm.expert_weight_bytes(dep.ffn_gpus, shared_expert=shared_on_f) / GB,
        )
    return (sm.attention_weight_bytes() + sm.expert_weight_bytes(dep.attn_gpus) + kv) / GB, 0.0


def max_seqs_by_memory(sm: StageModel, dep: Deployment) -> int:
    """Most sequences per attention GPU whose KV fits next to the weights (0: weights alone don't fit)."""
    weights_gb, ffn_gb = memory_gb(sm, Deployment(**{**asdict(dep), "seqs_per_gpu": 0}))
    if dep.mode == "afd" and ffn_gb > sm.ffn_hw.mem_gb * (1 - MEMORY_RESERVE):
        return 0
    room = sm.attn_hw.mem_gb * (1 - MEMORY_RESERVE) - weights_gb
    return max(0, int(room * GB // sm.kv_bytes_per_seq()))
