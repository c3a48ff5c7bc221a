"""The MoE decoder stack of DeepSeek-V2 / V3 (MLA over a paged latent cache, shared experts) and
Qwen3-MoE (GQA, models/gqa.py; no shared expert): the two families differ only in attention kind,
routing settings and which layers are dense, all read from the config.

Module names mirror the checkpoint (`model.layers.N.self_attn.kv_a_proj_with_mqa`, ...), so
weights load by name; the only exception is the routed experts (models/routed_experts.py),
stacked into `w13`/`w2` by the loader's mapping table. Every forward works on one flat batch of
tokens (see ForwardBatch).

The forward exists once, as operations on one micro-batch's state (`operations()`); every mode
arranges the same operations with its strategy (afd_engine/operations/strategy.py), and
`forward` is the single-mode arrangement. State keys a step starts with: "fb" (ForwardBatch),
"kv_cache" ([layers, slots, C + R]) and "rows" (logit rows); it ends with the logits as output.
Kernels come from the backends chosen by name (kernels/registry.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afd_engine.model_config import ModelConfig
from afd_engine.models.experts import ExpertExecutor, ExpertServer, LocalExpertExecutor, expert_operations
from afd_engine.models.forward_batch import ForwardBatch
from afd_engine.models.gqa import GQAttention
from afd_engine.models.indexer import Indexer
from afd_engine.models.norm import RMSNorm, linear
from afd_engine.models.rope import RotaryEmbedding, softmax_scale
from afd_engine.models.routed_experts import RoutedExperts, all_experts
from afd_engine.operations import Operation, run_micro_batches
from afd_engine.operations.strategy import SINGLE, LayerOps, ModelOps


class DenseMLP(nn.Module):
    """SwiGLU feed-forward: dense layers and the shared experts."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            linear(hidden, inter),
            linear(hidden, inter),
            linear(inter, hidden),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """Router: scores every expert, picks top-k (optionally group-limited) in fp32."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.group_size = cfg.n_routed_experts // cfg.n_group
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.uses_bias_correction:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> topk_ids [T, K] int64, topk_weights [T, K] fp32."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        if cfg.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(len(x), cfg.n_group, self.group_size).topk(2, dim=-1)[0].sum(-1)
            choice = self._mask_groups(choice, group_scores, float("-inf"))
            ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        elif cfg.topk_method == "group_limited_greedy":
            group_scores = scores.view(len(x), cfg.n_group, self.group_size).amax(-1)
            weights, ids = self._mask_groups(scores, group_scores, 0.0).topk(
                cfg.num_experts_per_tok, dim=-1, sorted=False
            )
        else:
            weights, ids = scores.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * cfg.routed_scaling_factor

    def _mask_groups(self, scores: torch.Tensor, group_scores: torch.Tensor, fill: float) -> torch.Tensor:
        """scores [T, E]: experts outside each token's top `topk_group` groups (group_scores [T, G]) get `fill`."""
        cfg = self.cfg
        top = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top, True)  # [T, G]
        grouped = scores.view(len(scores), cfg.n_group, self.group_size)
        return grouped.masked_fill(~keep[:, :, None], fill).view_as(scores)


class MoE(nn.Module):
    """Gate, routed experts and optional shared experts; its forward is the MoE layer's operations."""

    def __init__(self, cfg: ModelConfig, slot_expert, moe_kernels) -> None:
        super().__init__()
        self.gate = Gate(cfg)
        self.experts = RoutedExperts(cfg, slot_expert, moe_kernels)
        self.shared_experts = (
            DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts
            else None
        )


class MLAttention(nn.Module):
    """Multi-head latent attention; caches `kv_lora_rank + qk_rope_head_dim` values per token."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, kernels) -> None:
        super().__init__()
        self.cfg, self.rotary, self.kernels = cfg, rotary, kernels
        h, nh = cfg.hidden_size, cfg.num_heads
        if cfg.q_lora_rank:
            self.q_a_proj = linear(h, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = linear(cfg.q_lora_rank, nh * cfg.qk_head_dim)
        else:
            self.q_proj = linear(h, nh * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = linear(h, cfg.mla_cache_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = linear(nh * cfg.v_head_dim, h)
        self.scale = softmax_scale(cfg.rope, cfg.qk_head_dim)
        self.w_uk: torch.Tensor | None = None  # absorbed decode weights, set by prepare()
        self.w_uv: torch.Tensor | None = None
        # DeepSeek-V3.2: the indexer picks the tokens each query attends to (models/indexer.py)
        self.indexer = Indexer(cfg) if cfg.sparse_attention else None

    def prepare(self) -> None:
        """Derive the absorbed decode weights once the checkpoint is loaded."""
        cfg = self.cfg
        self.w_uk, self.w_uv = self.kernels.absorb(
            self.kv_b_proj.weight.data, cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        )

    def forward(self, x: torch.Tensor, fb: ForwardBatch, cos_sin, cache: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this step's latents into `cache` [slots, C + R]."""
        cfg = self.cfg
        T = x.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) if cfg.q_lora_rank else None
        q = self.q_b_proj(q_resid) if cfg.q_lora_rank else self.q_proj(x)
        q = q.view(T, cfg.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        cos, sin = cos_sin
        q_pe = self.rotary.apply(q_pe, cos, sin)
        mla = cache[:, : cfg.mla_cache_dim] if self.indexer is not None else cache
        mla[fb.out_slots] = torch.cat((self.kv_a_layernorm(latent), self.rotary.apply(k_pe, cos, sin)), dim=-1)
        if self.indexer is not None:  # every token, prefill or decode, attends to its chosen tokens
            chosen = self.indexer(x, q_resid, fb, cos_sin, cache[:, cfg.mla_cache_dim :])
            out = self.kernels.sparse(q_nope, q_pe, mla, chosen, self.w_uk, self.w_uv, self.scale)
            return self.o_proj(out.reshape(T, cfg.num_heads * cfg.v_head_dim))
        n_ext = fb.num_extend_tokens
        out = x.new_empty(T, cfg.num_heads, cfg.v_head_dim)
        if n_ext:
            out[:n_ext] = self._extend(q_nope[:n_ext], q_pe[:n_ext], fb, cache)
        if T > n_ext:
            out[n_ext:] = self.kernels.decode(
                q_nope[n_ext:], q_pe[n_ext:], cache, fb.paged_decode(), self.w_uk, self.w_uv, self.scale
            )
        return self.o_proj(out.view(T, cfg.num_heads * cfg.v_head_dim))

    def _extend(self, q_nope, q_pe, fb: ForwardBatch, cache) -> torch.Tensor:
        valid = fb.ext_valid  # [Be, Q]
        pad_nope = q_nope.new_zeros(*valid.shape, *q_nope.shape[1:])
        pad_pe = q_pe.new_zeros(*valid.shape, *q_pe.shape[1:])
        pad_nope[valid], pad_pe[valid] = q_nope, q_pe
        out = self.kernels.extend(
            pad_nope,
            pad_pe,
            cache,
            fb.ext_slots,
            fb.ext_kv_lens,
            fb.ext_positions,
            self.kv_b_proj.weight,
            self.cfg.v_head_dim,
            self.scale,
        )  # [Be, Q, H, Dv]
        return out[valid]


def _no_routes(h: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate's output for no tokens: topk_ids [0, K] int64, topk_weights [0, K] fp32."""
    return h.new_empty(0, top_k, dtype=torch.int64), h.new_empty(0, top_k, dtype=torch.float32)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, slot_expert, kernels) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = (GQAttention if cfg.attention == "gqa" else MLAttention)(cfg, rotary, kernels.attention)
        self.is_moe = cfg.is_moe_layer(layer_id)
        self.mlp = (
            MoE(cfg, slot_expert, kernels.moe) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def operations(self, executor: ExpertExecutor, server: ExpertServer | None = None) -> LayerOps:
        """Dense: attention, mlp. MoE: attention, gate, dispatch, [shared_expert,] combine, join; and
        with a `server`, the expert side of the experts held here (see models/experts.py)."""
        if not self.is_moe:
            return LayerOps(self.layer_id, False, self._named(("attention", self._attention), ("mlp", self._dense)))
        moe, layer_id = self.mlp, self.layer_id
        shared = moe.shared_experts

        def gate(st) -> None:
            h = st.get("h")
            st.set("topk", moe.gate(h) if len(h) else _no_routes(h, moe.gate.cfg.num_experts_per_tok))

        def dispatch(st) -> None:
            topk_ids, topk_weights = st.pop("topk")
            h = st.get("h") if shared is not None else st.pop("h")  # the shared expert consumes it
            st.set("routed", executor.dispatch(layer_id, st.micro_batch, h, topk_ids, topk_weights))

        def shared_expert(st) -> None:
            h = st.pop("h")
            st.set("shared", shared(h) if len(h) else h)

        def combine(st) -> None:
            st.set("routed_out", executor.combine(st.pop("routed")))

        def join(st) -> None:
            out = st.pop("routed_out")
            if shared is not None:
                out = out + st.pop("shared")
            st.set("x", st.pop("residual") + out)

        ops = [("attention", self._attention), ("gate", gate), ("dispatch", dispatch)]
        ops += [("shared_expert", shared_expert)] if shared is not None else []
        ops += [("combine", combine), ("join", join)]
        serve = expert_operations(layer_id, moe.experts, server) if server is not None and moe.experts.count else ()
        return LayerOps(layer_id, True, self._named(*ops), serve)

    def _named(self, *ops) -> tuple[Operation, ...]:
        return tuple(Operation(name, fn, self.layer_id) for name, fn in ops)

    def _attention(self, st) -> None:
        """x -> residual (the stream after attention) and h (the normalised MLP input), both [T, H].
        An empty micro-batch (a rank stepping in lockstep without tokens) computes nothing here, in
        the gate, the shared expert or the dense MLP: its tensors stay [0, H]."""
        x = st.pop("x")
        if not len(x):
            st.set("residual", x)
            st.set("h", x)
            return
        x = x + self.self_attn(
            self.input_layernorm(x), st.get("fb"), st.get("cos_sin"), st.get("kv_cache")[self.layer_id]
        )
        st.set("residual", x)
        st.set("h", self.post_attention_layernorm(x))

    def _dense(self, st) -> None:
        h = st.pop("h")
        st.set("x", st.pop("residual") + (self.mlp(h) if len(h) else h))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, expert_slots: dict[int, list[int]], kernels) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rope_dim)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotary, expert_slots.get(i, ()), kernels) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """The model of an attention rank (or the whole model in one process). `expert_slots` says which
    routed experts live here (per MoE layer, the logical expert of each slot; None: all, in order);
    `kernels` holds the chosen attention and MoE backends."""

    def __init__(self, cfg: ModelConfig, expert_slots: dict[int, list[int]] | None, kernels) -> None:
        super().__init__()
        self.config = cfg
        self.model = DeepseekModel(cfg, all_experts(cfg) if expert_slots is None else expert_slots, kernels)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size)
        self._local_ops: list | None = None
        self.load_recorder = None  # counts the gates' choices (eplb.recorder), set by the engine

    def prepare(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.prepare()
        if self.config.tie_word_embeddings:  # the checkpoint has no lm_head: it is the embedding
            self.lm_head.weight = self.model.embed_tokens.weight

    def operations(self, executor: ExpertExecutor, server: ExpertServer | None = None) -> ModelOps:
        """The forward as operations: embed, every layer's operations, logits."""
        layers = tuple(layer.operations(executor, server) for layer in self.served_layers)
        return ModelOps((Operation("embed", self._embed),), layers, (Operation("logits", self._logits),))

    def routed_experts(self, with_mtp: bool = False) -> dict[int, RoutedExperts]:
        """layer id -> the routed experts held here, per MoE layer (`with_mtp`: the MTP draft
        module's too, where it is held: models/mtp.py)."""
        layers = list(self.served_layers) + (list(getattr(self, "mtp", ())) if with_mtp else [])
        return {layer.layer_id: layer.mlp.experts for layer in layers if layer.is_moe}

    @property
    def served_layers(self):
        """The decoder layers of the forward (an MTP module held after them is not one: models/mtp.py)."""
        return self.model.layers[: self.config.num_layers]

    @torch.inference_mode()
    def forward(
        self, fb: ForwardBatch, kv_cache: torch.Tensor, logit_rows: torch.Tensor, hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Runs one step in this process; kv_cache [layers, slots, C + R]; returns fp32 logits
        [len(logit_rows), V], and with `hidden` also every token's last hidden state [T, H] before
        the final norm (what the MTP draft module reads: models/mtp.py)."""
        if self._local_ops is None:
            executor = LocalExpertExecutor(self.routed_experts(), self.load_recorder)
            self._local_ops = SINGLE.arrange(self.operations(executor))
        state = {"fb": fb, "kv_cache": kv_cache, "rows": logit_rows}
        if hidden:
            state["keep_hidden"] = True
        return run_micro_batches(self._local_ops, [state])[0]

    def _embed(self, st) -> None:
        """An empty micro-batch (a rank stepping in lockstep without tokens) gets x [0, H] and no
        rotary table, which its layers never read (DecoderLayer._attention)."""
        fb = st.get("fb")
        if not fb.num_tokens:
            weight = self.model.embed_tokens.weight
            st.set("x", weight.new_empty(0, weight.shape[1]))
            st.set("cos_sin", None)
            return
        x = self.model.embed_tokens(fb.input_ids)
        st.set("x", x)
        st.set("cos_sin", self.model.rotary.cos_sin(fb.positions, x.dtype))

    def _logits(self, st) -> None:
        for key in ("fb", "kv_cache", "cos_sin"):
            st.pop(key)
        x, rows = st.pop("x"), st.pop("rows")
        keep_hidden = "keep_hidden" in st and st.pop("keep_hidden")
        if not len(rows):  # no row wants logits (an empty micro-batch, or prefill chunks only)
            logits = x.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        else:
            logits = self.lm_head(self.model.norm(x[rows])).float()
        st.set_output((logits, x) if keep_hidden else logits)
