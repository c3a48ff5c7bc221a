"""Per-layer, per-micro-batch stage times on one GPU, from a roofline with efficiency factors.

Each kernel takes max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth); kernels of one stage
run one after another, so their times add. Weights are `weight_dtype` (fp8 by default: 8-bit, with
bf16 math on parts without fp8 units, as Step-3 assumes); the gate and the lm_head are bf16.
`attn_dtype` is the precision of the attention core and its KV cache (DeepSeek-V3 serves it in
bf16 over fp8 projections; Step-3 in fp8).

Sparse attention (DeepSeek-V3.2): per decode token and layer the lightning indexer scores every
cached token (index_n_heads x index_head_dim multiply-adds each, reading the token's index key) and
MLA attends to min(context, index_topk) of them, each a kernel of its own. `index_dtype` is the
precision of the indexer's keys and score math: fp8 by default, as DeepSeek's reference runs it on
GPUs (e4m3 keys and an fp32 scale per token), or bf16. Selecting the top index_topk is not counted.

`expert_imbalance` is the measured max over mean token load of the expert ranks (expert_load.py):
the busiest rank computes that many times the balanced straggler's rows. It scales the routed
experts' FLOPs (or a calibration's per-row term), not their weight reads (a rank reads at most its
own experts, all of them once a decode batch is large) nor the shared expert (not routed).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import log, sqrt

from afd_engine.errors import ConfigError
from afd_engine.planner.calibration import Calibration
from afd_engine.planner.expert_load import BALANCED, check_imbalance
from afd_engine.planner.hardware import Hardware
from afd_engine.planner.shapes import INDEX_DTYPES, ModelSpec

ATTN_DTYPES = {"fp8": 1, "bf16": 2}


def gemm_us(hw: Hardware, tokens: float, params: float, weight_bytes: int, dtype: str) -> float:
    """A GEMM of `tokens` rows through `params` weights (activations are small next to weights)."""
    if tokens <= 0 or params <= 0:
        return 0.0
    eff = hw.efficiency
    compute = 2 * tokens * params / (hw.tflops(dtype) * eff.gemm_compute * 1e6)
    memory = params * weight_bytes / (hw.mem_bw_tbs * eff.gemm_memory * 1e6)
    return max(compute, memory)


def expected_max_load(mean: float, bins: int) -> float:
    """Busiest of `bins` GPUs when tokens land on them at random (mean + sigma * sqrt(2 ln n)):
    the expert-parallel straggler under balanced routing, no hot experts."""
    if bins <= 1 or mean <= 0:
        return mean
    return mean + sqrt(mean) * sqrt(2 * log(bins))


@dataclass(frozen=True)
class StageModel:
    model: ModelSpec
    attn_hw: Hardware
    ffn_hw: Hardware
    context: int  # average cached tokens per sequence
    attn_dtype: str = "fp8"
    calibration: Calibration | None = None  # measured attention and expert stages replace the roofline
    weight_dtype: str = "fp8"  # projections, experts and dense FFNs (fp8: 8-bit, or int8 where no fp8 units)
    expert_imbalance: float = BALANCED  # max / mean token load of the expert ranks, measured
    index_dtype: str = "fp8"  # sparse attention: the indexer's cached keys and score math

    def __post_init__(self) -> None:
        if self.attn_dtype not in ATTN_DTYPES:
            raise ConfigError(f"--attn-dtype {self.attn_dtype!r} must be one of {', '.join(ATTN_DTYPES)}")
        if self.index_dtype not in INDEX_DTYPES:
            raise ConfigError(f"--index-cache-dtype {self.index_dtype!r} must be one of {', '.join(INDEX_DTYPES)}")
        if self.weight_dtype not in ATTN_DTYPES:
            raise ConfigError(f"--weight-dtype {self.weight_dtype!r} must be one of {', '.join(ATTN_DTYPES)}")
        if self.context < 1:
            raise ConfigError(f"--context must be >= 1 (got {self.context})")
        check_imbalance(self.expert_imbalance, "--expert-imbalance")

    @property
    def attn_bytes(self) -> int:
        return ATTN_DTYPES[self.attn_dtype]

    @property
    def w_bytes(self) -> int:
        return ATTN_DTYPES[self.weight_dtype]

    def attention_us(self, seqs: float, shared_expert: bool = True) -> float:
        """One MoE layer's A-side stage for `seqs` sequences: attention, gate and shared expert."""
        if seqs <= 0:
            return 0.0
        m, hw = self.model, self.attn_hw
        shared = gemm_us(hw, seqs, m.shared_params, self.w_bytes, self.weight_dtype) if shared_expert else 0.0
        if self.calibration is not None:
            return self.calibration.attention(seqs) + shared
        return (
            self.attention_core_us(seqs)
            + gemm_us(hw, seqs, m.attention.linear_params(m.hidden), self.w_bytes, self.weight_dtype)
            + gemm_us(hw, seqs, m.gate_params, 2, "bf16")
            + shared
            + hw.efficiency.layer_overhead_us
        )

    def attention_core_us(self, seqs: float) -> float:
        """The attention core of `seqs` decode tokens at `context`: the indexer over the whole
        context (sparse attention) and the attention over the positions it attends to."""
        a = self.model.attention
        per_seq = self.context * self.indexed_position_us() + a.attended(self.context) * self.attended_position_us()
        return seqs * per_seq

    def attended_position_us(self) -> float:
        """Decode attention-core time per attended cached position (one query token, one layer):
        a roofline of its FLOPs and the KV bytes it reads."""
        a, hw = self.model.attention, self.attn_hw
        eff = hw.efficiency
        compute = a.core_flops_per_position / (hw.tflops(self.attn_dtype) * eff.attn_compute * 1e6)
        memory = a.kv_elems_per_token * self.attn_bytes / (hw.mem_bw_tbs * eff.attn_memory * 1e6)
        return max(compute, memory)

    def indexed_position_us(self) -> float:
        """Decode indexer time per cached position it scores (one query token, one layer; 0 without
        sparse attention): a roofline of the score FLOPs and the index key's bytes."""
        a, hw = self.model.attention, self.attn_hw
        if not a.sparse:
            return 0.0
        eff = hw.efficiency
        compute = a.index_flops_per_position / (hw.tflops(self.index_dtype) * eff.attn_compute * 1e6)
        memory = a.index_key_bytes(self.index_dtype) / (hw.mem_bw_tbs * eff.attn_memory * 1e6)
        return max(compute, memory)

    def prefill_pair_us(self) -> tuple[float, float]:
        """(indexer, attention) compute time per query-key pair of a prefill chunk (one layer): the
        indexer scores each query against every causal key, the attention core runs over the
        pairs it attends to (all of them without sparse attention)."""
        a, hw = self.model.attention, self.attn_hw
        eff = hw.efficiency
        attention = a.prefill_flops_per_pair / (hw.tflops(self.attn_dtype) * eff.attn_compute * 1e6)
        if not a.sparse:
            return 0.0, attention
        return a.index_flops_per_position / (hw.tflops(self.index_dtype) * eff.attn_compute * 1e6), attention

    def dense_layer_us(self, seqs: float) -> float:
        """A dense (non-MoE) layer, all on the attention GPU."""
        if seqs <= 0:
            return 0.0
        m, hw = self.model, self.attn_hw
        return (
            self.attention_core_us(seqs)
            + gemm_us(hw, seqs, m.attention.linear_params(m.hidden), self.w_bytes, self.weight_dtype)
            + gemm_us(hw, seqs, m.dense_params, self.w_bytes, self.weight_dtype)
            + hw.efficiency.layer_overhead_us
        )

    def experts_us(
        self, tokens: float, ffn_gpus: int, hw: Hardware | None = None, shared_expert: bool = False
    ) -> float:
        """Routed experts on the busiest of `ffn_gpus` GPUs for `tokens` tokens in all (one layer,
        one micro-batch): a grouped GEMM over the GPU's experts that received any token; with
        `shared_expert` the GPU also runs the (replicated) shared expert on its 1/ffn_gpus of the tokens."""
        hw = hw or self.ffn_hw
        m = self.model
        if tokens <= 0:
            return 0.0
        shared = (
            gemm_us(hw, tokens / ffn_gpus, m.shared_params, self.w_bytes, self.weight_dtype) if shared_expert else 0.0
        )
        local_experts = m.experts / ffn_gpus
        copies = self.busiest_rank_rows(tokens, ffn_gpus)
        if self.calibration is not None:
            return self.calibration.ffn(copies) + shared
        hit = 1 - (1 - m.topk / m.experts) ** tokens  # chance an expert got at least one token
        eff = hw.efficiency
        compute = 2 * copies * m.expert_params / (hw.tflops(self.weight_dtype) * eff.gemm_compute * 1e6)
        memory = local_experts * hit * m.expert_params * self.w_bytes / (hw.mem_bw_tbs * eff.gemm_memory * 1e6)
        return max(compute, memory) + shared + eff.layer_overhead_us

    def busiest_rank_rows(self, tokens: float, ffn_gpus: int) -> float:
        """Token copies the busiest of `ffn_gpus` expert ranks computes for `tokens` tokens in all: the
        straggler of balanced routing (random fluctuation per step) times the measured imbalance
        (systematic skew, e.g. hot experts, counted over a window of many steps)."""
        return self.expert_imbalance * expected_max_load(tokens * self.model.topk / ffn_gpus, ffn_gpus)

    def head_us(self, seqs: float) -> float:
        """Embedding lookup, final norm and lm_head (bf16) for one step's sequences on one GPU."""
        m = self.model
        return gemm_us(self.attn_hw, seqs, m.vocab * m.hidden, 2, "bf16")

    # memory -----------------------------------------------------------------------------------
    def attention_weight_bytes(self, shared_expert: bool = True) -> float:
        m = self.model
        w = self.w_bytes
        per_layer = m.attention.linear_params(m.hidden) * w
        moe = m.moe_layers * (m.gate_params * 2 + (m.shared_params * w if shared_expert else 0))
        return m.layers * per_layer + m.dense_layers * m.dense_params * w + moe + 2 * m.vocab * m.hidden * 2

    def expert_weight_bytes(self, ffn_gpus: int, shared_expert: bool = False) -> float:
        m = self.model
        experts = -(-m.experts // ffn_gpus) * m.expert_params + (m.shared_params if shared_expert else 0)
        return m.moe_layers * experts * self.w_bytes

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token over all layers (with sparse attention, the index key too)."""
        return self.model.kv_bytes_per_token(self.attn_bytes, self.index_dtype)

    def kv_bytes_per_seq(self) -> float:
        return self.context * self.kv_bytes_per_token()
