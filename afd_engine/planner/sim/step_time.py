"""Step-time models: how long one lockstep step of an instance takes for the loads of its ranks.

`StageStepTime` is the planner's roofline through the same pipeline formula as `deploy.estimate`;
`LinearStepTime` is a straight line for tests and what-ifs; `step_calibration.FittedStepTime` is a
fit of this engine's own steps. Anything with a `roles` tuple and a `step` method will do; one
with a `draft_pass` method too prices speculative decoding's draft passes itself (speculative.py);
one with `prices_context` set gets four more arguments: whether another instance is in a step,
whether the instance's previous step prefilled, whether requests whose KV came from a prefill
instance join the step, and how many requests left the instance since its previous step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from afd_engine.errors import ConfigError
from afd_engine.planner.deploy import Deployment, moe_layers_time, pipeline_period
from afd_engine.planner.network import CommCase, comm_time
from afd_engine.planner.stages import StageModel

# A load is what one rank puts into one step:
#   (tokens, sequences, KV positions its decodes read, query-key pairs of its prefill chunks)
# and, with sparse attention (DeepSeek-V3.2), two more: the positions and pairs its attention
# attends to (at most index_topk per query token) while the indexer scores all of them. A load of
# four attends to all it reads.
Load = tuple[float, ...]


class StepTimeModel(Protocol):
    """The time of one lockstep step of an instance, from the loads of its ranks that have work.

    `roles` names the GPU roles whose busy time `step` reports (e.g. ("attention", "ffn")); `step`
    returns (seconds, busy seconds per GPU of each role, in `roles` order)."""

    roles: tuple[str, ...]

    def step(self, loads: Sequence[Load]) -> tuple[float, tuple[float, ...]]: ...


@dataclass(frozen=True)
class LinearStepTime:
    """A step of `fixed_s + per_token_s * tokens` on the busiest rank (tests and what-ifs)."""

    fixed_s: float
    per_token_s: float
    roles: tuple[str, ...] = ("gpu",)

    def step(self, loads: Sequence[Load]) -> tuple[float, tuple[float, ...]]:
        seconds = self.fixed_s + self.per_token_s * max(ld[0] for ld in loads)
        return seconds, (seconds,) * len(self.roles)


class StageStepTime:
    """One instance's step from the planner's stage model, with the batch, context and tokens of
    each rank as they are in this step (`deploy.estimate` does the same for a uniform batch).

    Per MoE layer and micro-batch the attention stage of rank i takes its share (1/m) of the rank's
    tokens through the projections, gate and shared expert (`StageModel.attention_us` without its
    core), plus the attention core: decode positions at the roofline's per-position cost, prefill
    query-key pairs at the compute roofline (with sparse attention, the indexer over all positions
    and pairs and the attention over those it attends to). The slowest rank sets the stage
    (lockstep). The expert stage takes all ranks' tokens (`StageModel.experts_us`, times the expert
    imbalance); dispatch and combine come from `network.comm_time` for the busiest rank's tokens.
    `deploy.pipeline_period` and `moe_layers_time` turn these into the MoE layers' time; dense
    layers, the lm_head over the sampled sequences and the fixed per-step overhead are added, as in
    `estimate`.

    With a calibration the measured attention line replaces projections and core alike (it has no
    context term), and the measured expert line the grouped GEMM."""

    def __init__(
        self,
        sm: StageModel,
        mode: str,
        attn_ranks: int,
        ffn_gpus: int,
        micro_batches: int = 1,
        dispatch: str = "two-stage",
        shared_expert: str = "attention",
        max_tokens: int = 2048,
    ) -> None:
        if mode not in ("afd", "colocated"):
            raise ConfigError(f"instance mode {mode!r} must be 'afd' or 'colocated'")
        Deployment(
            mode, attn_ranks, ffn_gpus if mode == "afd" else 0, micro_batches, 0, dispatch, shared_expert
        ).validate()
        self.sm, self.mode, self.afd = sm, mode, mode == "afd"
        self.attn_ranks, self.m = attn_ranks, micro_batches
        self.ep = ffn_gpus if self.afd else attn_ranks
        self.dispatch = dispatch if self.afd else "direct"
        self.shared_on_f = self.afd and shared_expert == "ffn"
        self.roles = ("attention", "ffn") if self.afd else ("gpu",)
        model, hw = sm.model, sm.attn_hw
        self.moe_layers, self.dense_layers = model.moe_layers, model.dense_layers
        self.overhead_us = hw.efficiency.step_overhead_us
        m = micro_batches
        calibrated = sm.calibration is not None
        # attention core: linear in positions (decode) and in query-key pairs (prefill), those the
        # indexer scores and those the attention attends to
        index_pair_us, pair_us = sm.prefill_pair_us()
        self.index_pos_us = 0.0 if calibrated else sm.indexed_position_us()
        self.index_pair_us = 0.0 if calibrated else index_pair_us
        self.pos_us = 0.0 if calibrated else sm.attended_position_us()
        self.pair_us = 0.0 if calibrated else pair_us
        # everything else on the attention GPU, per micro-batch, indexed by the rank's tokens
        n = max_tokens + 1
        core = [0.0 if calibrated else sm.attention_core_us(t / m) for t in range(n)]
        self.attn_rest = [sm.attention_us(t / m, shared_expert=not self.shared_on_f) - core[t] for t in range(n)]
        self.dense_rest = [sm.dense_layer_us(t / m) - core[t] for t in range(n)] if self.dense_layers else None
        self._ffn = lru_cache(maxsize=None)(self._ffn_us)
        self._comm = lru_cache(maxsize=None)(self._comm_us)
        self._head = lru_cache(maxsize=None)(sm.head_us)

    def _ffn_us(self, total_tokens: int) -> float:
        hw = self.sm.ffn_hw if self.afd else self.sm.attn_hw
        return self.sm.experts_us(total_tokens / self.m, self.ep, hw=hw, shared_expert=self.shared_on_f)

    def _comm_us(self, tokens: int) -> tuple[float, float, float, float]:
        sm = self.sm
        case = CommCase(
            tokens=tokens,
            hidden=sm.model.hidden,
            topk=sm.model.topk,
            experts=sm.model.experts,
            senders=self.attn_ranks,
            receivers=self.ep,
            mode=self.dispatch,
            symmetric=not self.afd,
            imbalance=sm.expert_imbalance,
        )
        c = comm_time(case, sm.attn_hw, sm.ffn_hw if self.afd else None)
        return c.dispatch_us, c.combine_us, c.dispatch_busy_us, c.combine_busy_us

    def step(self, loads: Sequence[Load]) -> tuple[float, tuple[float, ...]]:
        return self._time(loads, self.moe_layers, self.dense_layers, self.overhead_us)

    def draft_pass(self, loads: Sequence[Load]) -> tuple[float, tuple[float, ...]]:
        """One pass of the MTP module (speculative decoding) over `loads`: one MoE layer and its
        head, without the per-step overhead (as `deploy.estimate` counts it)."""
        return self._time(loads, 1, 0, 0.0)

    def _time(
        self, loads: Sequence[Load], moe_layers: int, dense_layers: int, overhead_us: float
    ) -> tuple[float, tuple[float, ...]]:
        m, attn_rest, dense_rest = self.m, self.attn_rest, self.dense_rest
        pos_us, pair_us, index_pos_us, index_pair_us = self.pos_us, self.pair_us, self.index_pos_us, self.index_pair_us
        t_a = t_dense = 0.0
        t_max = total = seqs_max = 0
        a_sum = 0.0
        for ld in loads:
            tokens, seqs = ld[0], ld[1]
            # (the last two entries: what the attention attends to; ld[2:4] for a dense load)
            core = (index_pos_us * ld[2] + index_pair_us * ld[3] + pos_us * ld[-2] + pair_us * ld[-1]) / m
            a = attn_rest[tokens] + core
            a_sum += a
            if a > t_a:
                t_a = a
            if dense_rest is not None:
                d = dense_rest[tokens] + core
                if d > t_dense:
                    t_dense = d
            total += tokens
            if tokens > t_max:
                t_max = tokens
            if seqs > seqs_max:
                seqs_max = seqs
        t_f = self._ffn(total)
        d, c, d_busy, c_busy = self._comm(round(t_max / m))
        round_trip = t_a + d + t_f + c
        period, _ = pipeline_period(m, t_a, t_f, d_busy, c_busy, round_trip, self.afd)
        a_work = t_a if self.afd else t_a + t_f
        moe = moe_layers_time(moe_layers, m, period, a_work, round_trip)
        head = self._head(seqs_max)
        dense = dense_layers * m * t_dense
        step_us = overhead_us + head + dense + moe
        # busy time per GPU of each role: the attention work averaged over all attention ranks
        # (idle ones included), the expert stage on the busiest expert GPU
        attn_busy = moe_layers * m * a_sum / self.attn_ranks + dense + head
        ffn_busy = moe_layers * m * t_f
        if self.afd:
            return step_us * 1e-6, (attn_busy * 1e-6, ffn_busy * 1e-6)
        return step_us * 1e-6, ((attn_busy + ffn_busy) * 1e-6,)
