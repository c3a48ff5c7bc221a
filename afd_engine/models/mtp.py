"""DeepSeek's multi-token prediction (MTP) module: the draft model of speculative decoding.

DeepSeek-V3 checkpoints store it as one more decoder layer after the last (`num_nextn_predict_layers`
of them, layer ids from `num_hidden_layers` on), with its own glue:

    x      = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])      h_i: the main model's last hidden
                                                                state at position i, before its norm
    x'     = the layer's decoder block on x at position i        (its own attention and KV cache
                                                                layer, its own MoE)
    logits = shared_head.head(shared_head.norm(x'))              the distribution of t_{i+2}

The embedding is the main model's (the checkpoint's copy, `model.layers.N.embed_tokens`, is the
same tensor and is not read). The concatenation puts the normalised embedding first, as the
released checkpoints' projections expect (the report writes the two the other way round).

`MTPLayer` is a `DecoderLayer` (the block is the same code as every layer, held at
`model.layers.N` so the checkpoint's names load as they are) plus the glue; `load_model(...,
mtp=True)` attaches it; runtime/spec_step.py drives it.
"""

from __future__ import annotations

import torch
from torch import nn

from afd_engine.errors import ConfigError
from afd_engine.model_config import ModelConfig
from afd_engine.models.deepseek import DecoderLayer
from afd_engine.models.experts import ExpertExecutor, ExpertServer, LocalExpertExecutor
from afd_engine.models.forward_batch import ForwardBatch
from afd_engine.models.norm import RMSNorm, linear
from afd_engine.operations import Operation, run_micro_batches
from afd_engine.operations.strategy import SINGLE, ModelOps


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = linear(cfg.hidden_size, cfg.vocab_size)


class MTPLayer(DecoderLayer):
    """One MTP module (module doc): a decoder block at layer id `layer_id` and its glue. `slots`:
    the routed experts held here (the logical expert of each slot; None: all of them)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary, kernels, slots: list[int] | None = None) -> None:
        if slots is None:
            slots = list(range(cfg.n_routed_experts)) if cfg.is_moe_layer(layer_id) else ()
        super().__init__(cfg, layer_id, rotary, slots, kernels)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = linear(2 * h, h)
        self.shared_head = SharedHead(cfg)
        self._embed_tokens = [None]  # the main model's embedding (a list: not a submodule), set by attach_mtp
        self._rotary = rotary  # not a submodule: the main model's
        self._ops: list | None = None

    def draft_operations(self, executor: ExpertExecutor | None, server: ExpertServer | None = None) -> ModelOps:
        """One draft pass as operations, for any strategy to arrange: the glue, the block (its MoE
        through `executor`; with a `server`, the expert side of the experts held here), the head.
        A micro-batch starts with "fb", "kv_cache", "next_ids" [T], "hidden" [T, H] and "rows"; it
        ends with (fp32 logits [len(rows), V], the block's output at rows [len(rows), H])."""
        layer = self.operations(executor, server)
        return ModelOps((Operation("mtp_input", self._input),), (layer,), (Operation("mtp_head", self._head),))

    @torch.inference_mode()
    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        fb: ForwardBatch,
        kv_cache: torch.Tensor,
        rows: torch.Tensor,
        with_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """In this process. embeds [T, H]: the main model's embedding of each position's next token;
        hidden [T, H]: the main model's last hidden state there (before its norm); `fb`: the
        positions and KV slots of this layer's cache (kv_cache [layers, slots, dim], this layer's id
        among the layers); returns fp32 logits [len(rows), V] of the token after next, and with
        `with_hidden` also the block's output at `rows` [len(rows), H] (before the head's norm): the
        `hidden` of a chained draft step at the next position."""
        if self._ops is None:
            executor = LocalExpertExecutor({self.layer_id: self.mlp.experts}) if self.is_moe else None
            self._ops = SINGLE.arrange(self.draft_operations(executor))
        state = {"fb": fb, "kv_cache": kv_cache, "embeds": embeds, "hidden": hidden, "rows": rows}
        logits, out = run_micro_batches(self._ops, [state])[0]
        return (logits, out) if with_hidden else logits

    def _input(self, st) -> None:
        """x = eh_proj([enorm(embed(next token)) ; hnorm(hidden)]) and the rotary table of the
        positions; an empty micro-batch (a lockstep rank without tokens) gets x [0, H]."""
        embeds = st.pop("embeds") if "embeds" in st else self._embed_tokens[0](st.pop("next_ids"))
        hidden = st.pop("hidden")
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        st.set("x", x)
        st.set("cos_sin", self._rotary.cos_sin(st.get("fb").positions, x.dtype) if len(x) else None)

    def _head(self, st) -> None:
        for key in ("fb", "kv_cache", "cos_sin"):
            st.pop(key)
        x = st.pop("x")[st.pop("rows")]
        st.set_output((self.shared_head.head(self.shared_head.norm(x)).float(), x))


def attach_mtp(model, cfg: ModelConfig, kernels, slots: list[int] | None = None) -> MTPLayer:
    """Adds the checkpoint's first MTP module to a DeepSeek model (on meta, before loading): held at
    `model.layers.N` after the served layers, which the forward never runs. `slots`: its routed
    experts held here (None: all; an AFD attention rank holds none)."""
    if cfg.attention != "mla":
        raise ConfigError(
            f"speculative decoding drafts with DeepSeek's multi-token prediction module; {cfg.architecture}'s "
            "is not read (--speculative-algorithm needs a DeepSeek-V3-architecture checkpoint)"
        )
    if not cfg.mtp_layers:
        raise ConfigError(
            f"{cfg.architecture} checkpoint declares num_nextn_predict_layers={cfg.mtp_layers}: it has no "
            "multi-token prediction module to draft with (--speculative-algorithm needs one)"
        )
    layer = MTPLayer(cfg, cfg.num_layers, model.model.rotary, kernels, slots)
    layer._embed_tokens[0] = model.model.embed_tokens
    model.model.layers.append(layer)
    model.mtp = [layer]  # a list: not a second registration of the same module
    return layer
