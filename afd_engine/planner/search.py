"""Search for the deployment with the most tokens per GPU per second under a TPOT SLO.

For each candidate topology (AFD: attention nodes x FFN nodes x micro-batches; colocated: EP size x
micro-batches) the batch per attention GPU is the largest that fits in memory and meets the SLO:
TPOT grows with the batch and TPOT/batch does not, so tokens/GPU/s is highest at that batch and a
bisection finds it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from afd_engine.errors import ConfigError
from afd_engine.planner.deploy import Deployment, Estimate, estimate, max_seqs_by_memory
from afd_engine.planner.stages import StageModel

NODE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16)
COLOCATED_GPUS = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class SearchSpace:
    """Candidates; None means the defaults above (and 1-4 micro-batches for AFD, 1-2 colocated)."""

    attn_gpus: tuple[int, ...] | None = None
    ffn_gpus: tuple[int, ...] | None = None
    micro_batches: tuple[int, ...] | None = None
    total_gpus: int | None = None  # keep only topologies with exactly this many GPUs
    dispatch: str = "two-stage"
    shared_expert: tuple[str, ...] = ("attention", "ffn")  # AFD placements to try
    mtp_steps: int = 0  # speculative decoding: drafts per request and step (deploy.py)
    accept_length: float = 1.0


def best_batch(sm: StageModel, dep: Deployment, tpot_slo_ms: float) -> Estimate | None:
    """`dep` with the largest batch that fits and meets the SLO, or None if not even N sequences do."""
    hi = max_seqs_by_memory(sm, dep)
    lo = dep.micro_batches  # at least one sequence per micro-batch
    if hi < lo or estimate(sm, replace(dep, seqs_per_gpu=lo)).tpot_ms > tpot_slo_ms:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate(sm, replace(dep, seqs_per_gpu=mid)).tpot_ms <= tpot_slo_ms:
            lo = mid
        else:
            hi = mid - 1
    return estimate(sm, replace(dep, seqs_per_gpu=lo))


def candidates(sm: StageModel, mode: str, space: SearchSpace) -> list[Deployment]:
    experts = sm.model.experts
    if mode == "colocated":
        gpus = space.attn_gpus or ((space.total_gpus,) if space.total_gpus else COLOCATED_GPUS)
        mbs = space.micro_batches or (1, 2)
        spec = dict(mtp_steps=space.mtp_steps, accept_length=space.accept_length)
        return [Deployment("colocated", g, 0, n, 0, "direct", **spec) for g in gpus for n in mbs if g <= experts]
    if mode != "afd":
        raise ConfigError(f"--mode {mode!r} must be 'afd' or 'colocated'")
    a_gpus = space.attn_gpus or tuple(k * sm.attn_hw.gpus_per_node for k in NODE_COUNTS)
    f_gpus = space.ffn_gpus or tuple(k * sm.ffn_hw.gpus_per_node for k in NODE_COUNTS)
    mbs = space.micro_batches or (1, 2, 3, 4)
    return [
        Deployment("afd", a, f, n, 0, space.dispatch, s, space.mtp_steps, space.accept_length)
        for a in a_gpus
        for f in f_gpus
        for n in mbs
        for s in space.shared_expert
        if f <= experts and (space.total_gpus is None or a + f == space.total_gpus)
    ]


def search(sm: StageModel, mode: str, tpot_slo_ms: float, space: SearchSpace = SearchSpace()) -> list[Estimate]:
    """Every feasible candidate at its best batch, best first."""
    if tpot_slo_ms <= 0:
        raise ConfigError(f"--tpot-slo-ms must be > 0 (got {tpot_slo_ms})")
    cands = candidates(sm, mode, space)
    if not cands:
        raise ConfigError(
            f"no {mode} topology matches the constraints (GPUs {space.total_gpus}, {sm.model.experts} experts)"
        )
    found = [e for e in (best_batch(sm, d, tpot_slo_ms) for d in cands) if e is not None]
    return sorted(found, key=lambda e: (-e.tokens_per_gpu_s, e.deployment.gpus))


def frontier(sm: StageModel, mode: str, slos_ms: list[float], space: SearchSpace = SearchSpace()) -> list[Estimate]:
    """The best deployment at each SLO: throughput against TPOT."""
    out = []
    for slo in slos_ms:
        best = search(sm, mode, slo, space)
        if best:
            out.append(best[0])
    return out
