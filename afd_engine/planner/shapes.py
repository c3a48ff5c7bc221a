"""The arithmetic of one MoE model's shape: parameters per layer, attention-core FLOPs and KV bytes.

`Attention` is one attention layer: MLA (a latent per token, absorbed decode), GQA, or Step-3's MFA;
an MLA layer with `index_topk` is DeepSeek-V3.2's sparse attention, where a lightning indexer
scores every cached token and MLA attends only to the best `index_topk` of them. `ModelSpec` is
the whole model. Counts are in parameters and elements; byte sizes depend on the precision the
planner is asked about.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes per value of the indexer's cached key. fp8: e4m3 values plus one fp32 scale per token and
# layer, as DeepSeek's reference (and the engine's --index-cache-dtype fp8) stores it.
INDEX_DTYPES = {"fp8": 1, "bf16": 2}
INDEX_SCALE_BYTES = 4


@dataclass(frozen=True)
class Attention:
    """One attention layer. kind: mla (latent cache, absorbed decode), gqa, or mfa (Step-3: all
    query heads share one K and one V head, queries through a low-rank bottleneck). An mla layer
    with `index_topk` > 0 is sparse (DeepSeek-V3.2): an indexer of `index_heads` heads of
    `index_head_dim` scores every cached token, and MLA attends to the best `index_topk`."""

    kind: str
    heads: int
    head_dim: int = 128  # gqa/mfa; mla: v_head_dim
    kv_heads: int = 1  # gqa
    q_lora_rank: int = 0  # mla q_lora_rank / mfa query rank; 0: full-rank queries
    kv_lora_rank: int = 0  # mla
    qk_nope_dim: int = 0  # mla
    qk_rope_dim: int = 0  # mla
    index_topk: int = 0  # sparse mla: cached tokens each query token attends to; 0: all of them
    index_heads: int = 0
    index_head_dim: int = 0

    @property
    def sparse(self) -> bool:
        return self.index_topk > 0

    def linear_params(self, hidden: int) -> int:
        """Weights touched per token outside the attention core (projections in and out, and the
        indexer's: wq_b from the q-LoRA residual, wk and weights_proj from the hidden state)."""
        h = hidden
        if self.kind == "mla":
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = h * self.q_lora_rank + self.q_lora_rank * self.heads * qk if self.q_lora_rank else h * self.heads * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_dim)
            absorbed = self.heads * self.kv_lora_rank * (self.qk_nope_dim + self.head_dim)  # kv_b, absorbed
            indexer = (
                self.q_lora_rank * self.index_heads * self.index_head_dim
                + h * self.index_head_dim
                + h * self.index_heads
            )
            return q + kv_a + absorbed + self.heads * self.head_dim * h + indexer
        q_dim = self.heads * self.head_dim
        q = h * self.q_lora_rank + self.q_lora_rank * q_dim if self.q_lora_rank else h * q_dim
        kv = 2 * h * self.kv_heads * self.head_dim
        return q + kv + q_dim * h

    @property
    def kv_elems_per_token(self) -> int:
        """Cached elements per token and layer that the attention core reads for each token it
        attends to (MLA's latent and rope key; the indexer's key is counted by index_key_bytes)."""
        if self.kind == "mla":
            return self.kv_lora_rank + self.qk_rope_dim
        return 2 * self.kv_heads * self.head_dim

    def index_key_bytes(self, dtype: str) -> int:
        """Bytes of the indexer's key per token and layer (0 without sparse attention)."""
        if not self.sparse:
            return 0
        return self.index_head_dim * INDEX_DTYPES[dtype] + (INDEX_SCALE_BYTES if dtype == "fp8" else 0)

    @property
    def core_flops_per_position(self) -> int:
        """FLOPs of one query token against one attended position (scores + weighted sum)."""
        if self.kind == "mla":  # absorbed: scores over rope+latent, values over the latent
            return 2 * self.heads * (2 * self.kv_lora_rank + self.qk_rope_dim)
        return 2 * self.heads * 2 * self.head_dim

    @property
    def index_flops_per_position(self) -> int:
        """FLOPs of the indexer's scores of one query token against one cached token."""
        return 2 * self.index_heads * self.index_head_dim

    @property
    def prefill_flops_per_pair(self) -> int:
        """Attention-core FLOPs per (query, attended key) pair of a prefill chunk. Dense MLA
        prefills un-absorbed (keys and values expanded per head, cheaper per pair); sparse MLA keeps
        the absorbed form, since every query attends to its own set of latents."""
        if self.kind == "mla" and not self.sparse:
            return 2 * self.heads * (self.qk_nope_dim + self.qk_rope_dim + self.head_dim)
        return self.core_flops_per_position

    def attended(self, context: float) -> float:
        """Cached positions one query token at `context` attends to."""
        return min(context, self.index_topk) if self.sparse else context


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    vocab: int
    attention: Attention
    dense_layers: int  # layers with a dense FFN instead of MoE
    dense_width: int
    experts: int
    topk: int
    expert_width: int
    shared_experts: int
    shared_width: int
    default_attn_dtype: str = "fp8"  # precision of the attention core and KV cache it is usually served in

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_width  # gate, up, down

    @property
    def shared_params(self) -> int:
        return self.shared_experts * 3 * self.hidden * self.shared_width

    @property
    def dense_params(self) -> int:
        return 3 * self.hidden * self.dense_width

    @property
    def gate_params(self) -> int:
        return self.hidden * self.experts

    @property
    def sparsity(self) -> float:
        """Step-3's S: activated over total experts, the shared ones counted as experts of the same width."""
        shared = self.shared_params / self.expert_params
        return (self.topk + shared) / (self.experts + shared)

    def kv_bytes_per_token(self, kv_bytes: int, index_dtype: str = "fp8") -> int:
        """KV cache bytes of one token over all layers: the attention's elements at `kv_bytes` each,
        and with sparse attention the indexer's key in `index_dtype` (stored in the same row)."""
        a = self.attention
        return self.layers * (a.kv_elems_per_token * kv_bytes + a.index_key_bytes(index_dtype))

    def total_params(self) -> int:
        a = self.attention.linear_params(self.hidden)
        moe = self.moe_layers * (self.experts * self.expert_params + self.shared_params + self.gate_params)
        return self.layers * a + self.dense_layers * self.dense_params + moe + 2 * self.vocab * self.hidden

    def activated_params(self) -> int:
        """Parameters a token passes through, the embedding table and LM head included."""
        a = self.attention.linear_params(self.hidden)
        moe = self.moe_layers * (self.topk * self.expert_params + self.shared_params + self.gate_params)
        return self.layers * a + self.dense_layers * self.dense_params + moe + 2 * self.vocab * self.hidden
