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


def estimate(sm: StageModel, dep: Deployment) -> Estimate:
    dep.validate()
    m, n = sm.model, dep.micro_batches
    b = dep.seqs_per_gpu / n
    afd = dep.mode == "afd"
    ep = dep.ffn_gpus if afd else dep.attn_gpus
    shared_on_f = dep.shared_expert == "ffn"
    t_a = sm.attention_us(b, shared_expert=not shared_on_f)
    t_f = sm.experts_us(b * dep.attn_gpus, ep, hw=sm.ffn_hw if afd else sm.attn_hw, shared_expert=shared_on_f)
    case = CommCase(
        tokens=round(b),
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
    t_d, t_c = comm.dispatch_us, comm.combine_us
    round_trip = t_a + t_d + t_f + t_c
    period, bound = pipeline_period(n, t_a, t_f, comm.dispatch_busy_us, comm.combine_busy_us, round_trip, afd)
    a_work = t_a if afd else t_a + t_f
    moe_us = moe_layers_time(m.moe_layers, n, period, a_work, round_trip)
    step_us = (
        sm.attn_hw.efficiency.step_overhead_us
        + sm.head_us(dep.seqs_per_gpu)
        + m.dense_layers * n * sm.dense_layer_us(b)
        + moe_us
    )
    tokens_per_s = dep.seqs_per_gpu * dep.attn_gpus / (step_us * 1e-6) if dep.seqs_per_gpu else 0.0
    attn_gb, ffn_gb = memory_gb(sm, dep)
    fits = attn_gb <= sm.attn_hw.mem_gb * (1 - MEMORY_RESERVE) and (
        not afd or ffn_gb <= sm.ffn_hw.mem_gb * (1 - MEMORY_RESERVE)
    )
    return Estimate(
        dep,
        step_us / 1e3,
        tokens_per_s / dep.gpus,
        tokens_per_s,
        t_a,
        t_f,
        t_d,
        t_c,
        period,
        n * a_work / period if period else 0.0,
        n * t_f / period if period else 0.0,
        bound,
        attn_gb,
        ffn_gb,
        fits,
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
