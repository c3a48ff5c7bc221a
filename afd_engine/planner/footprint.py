"""A model's size and memory per GPU role at full size (`afd plan model`): parameters, KV bytes per
token, the weights an attention GPU and an FFN GPU of an AFD deployment hold, how many tokens of KV
fit next to them (deploy.memory_gb's accounting), and the decode attention core's time per token
at given contexts (stages.StageModel.attention_core_us)."""

from __future__ import annotations

from dataclasses import replace

from afd_engine.planner.deploy import GB, MEMORY_RESERVE, Deployment, memory_gb
from afd_engine.planner.hardware import Hardware
from afd_engine.planner.shapes import Attention, ModelSpec
from afd_engine.planner.stages import StageModel


def attention_kind(a: Attention) -> str:
    """The attention as the table shows it, e.g. "MLA", "MLA, top-2048 indexer", "GQA 96/8"."""
    if a.kind == "mla":
        return f"MLA, top-{a.index_topk} indexer" if a.sparse else "MLA"
    if a.kind == "gqa":
        return f"GQA {a.heads}/{a.kv_heads}"
    return "MFA"


def footprint(
    model: ModelSpec,
    hw: Hardware,
    ffn_gpus: int,
    attn_dtype: str,
    weight_dtype: str = "fp8",
    index_dtype: str = "fp8",
    contexts: tuple[int, ...] = (),
) -> dict:
    """Sizes of `model` on `hw` with its routed experts over `ffn_gpus` GPUs and the shared expert
    on the attention side; GB are 1e9 bytes, each GPU keeps MEMORY_RESERVE of its memory back. For
    each of `contexts`, one decode token's attention core per layer (us) and the KV of one sequence (GB)."""
    sm = StageModel(model, hw, hw, 1, attn_dtype, weight_dtype=weight_dtype, index_dtype=index_dtype)
    usable = hw.mem_gb * (1 - MEMORY_RESERVE)
    attn_gb, ffn_gb = memory_gb(sm, Deployment("afd", 1, ffn_gpus, 1, 0))
    kv = sm.kv_bytes_per_token()
    fitting = [f for f in range(1, model.experts + 1) if sm.expert_weight_bytes(f) / GB <= usable]
    return {
        "model": model.name,
        "attention": attention_kind(model.attention),
        "layers": model.layers,
        "moe_layers": model.moe_layers,
        "experts": f"{model.experts} top-{model.topk}"
        + (f" + {model.shared_experts} shared" if model.shared_experts else ""),
        "total_params_b": model.total_params() / 1e9,
        "activated_params_b": model.activated_params() / 1e9,
        "attn_dtype": attn_dtype,
        "weight_dtype": weight_dtype,
        "index_dtype": index_dtype if model.attention.sparse else None,
        "kv_bytes_per_token": kv,
        "attn_weights_gb": attn_gb,
        "ffn_gpus": ffn_gpus,
        "ffn_weights_gb": ffn_gb,
        "ffn_fits": ffn_gb <= usable,
        "min_ffn_gpus": fitting[0] if fitting else None,
        "kv_tokens_per_attn_gpu": max(0, int((usable - attn_gb) * GB // kv)),
        "attention_core_us": {c: replace(sm, context=c).attention_core_us(1) for c in contexts},
        "kv_gb_per_seq": {c: c * kv / GB for c in contexts},
    }


def print_footprints(rows: list[dict], hw_name: str, mem_gb: float) -> None:
    """The human table of `afd plan model`."""
    print(
        f"{'model':<18} {'attention':<22} {'params B':>13} {'KV dtype':>13} {'KV B/token':>10} "
        f"{'attn GPU GB':>11} {'FFN GPU GB':>14} {'min F':>5} {'KV tokens/attn GPU':>18}"
    )
    for r in rows:
        params = f"{r['total_params_b']:.1f}/{r['activated_params_b']:.1f}"
        kv = r["attn_dtype"] + (f"+{r['index_dtype']} idx" if r["index_dtype"] else "")
        ffn = f"{r['ffn_weights_gb']:.1f} (F={r['ffn_gpus']})" + ("" if r["ffn_fits"] else "!")
        print(
            f"{r['model'][:18]:<18} {r['attention']:<22} {params:>13} {kv:>13} {r['kv_bytes_per_token']:>10,} "
            f"{r['attn_weights_gb']:>11.1f} {ffn:>14} {r['min_ffn_gpus'] or '-':>5} {r['kv_tokens_per_attn_gpu']:>18,}"
        )
    contexts = sorted({c for r in rows for c in r["attention_core_us"]})
    if contexts:
        print("\ndecode attention core, us per token and layer (KV GB per sequence), at context:")
        print(f"{'model':<18} " + " ".join(f"{c:>18,}" for c in contexts))
        for r in rows:
            cells = [f"{r['attention_core_us'][c]:.2f} ({r['kv_gb_per_seq'][c]:.2f})" for c in contexts]
            print(f"{r['model'][:18]:<18} " + " ".join(f"{x:>18}" for x in cells))
    weights = ", ".join(sorted({r["weight_dtype"] for r in rows}))
    print(
        f"{hw_name} ({mem_gb:g} GB, {MEMORY_RESERVE:.0%} kept back), weights {weights}. params: total/activated "
        "(embedding and LM head included); KV dtype: attention cache (+ the indexer's keys); attn GPU: weights "
        "besides the routed experts (shared expert included); FFN GPU: routed experts over F GPUs ('!': does "
        "not fit); min F: fewest FFN GPUs whose experts fit; KV tokens: what fits next to the attention weights"
    )
