"""The checkpoint bench_vs_vllm.py serves on both engines: a tiny random DeepSeek-V3 with DeepSeek-V3's
real attention dimensions (vLLM's CPU MLA kernels accept no other head sizes), or an existing
checkpoint, checked for those dimensions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# DeepSeek-V3's attention dimensions: vLLM's CPU MLA decode kernel is built for this latent size
# (kv_lora_rank 512) and rope head size 64 only.
DSV3_ATTENTION = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
# The rest is small so that the model serves at useful speeds on two cores: 4 layers (1 dense,
# 3 MoE with 16 routed experts, top-4 of 4 groups, 1 shared expert, as in the tiny preset). The
# query goes through a LoRA as in DeepSeek-V3 (whose rank, 1536, neither engine's kernels
# constrain; it is scaled down with the hidden size).
BENCH_MODEL_OVERRIDES = {
    **DSV3_ATTENTION,
    "q_lora_rank": 128,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
}


def has_dsv3_attention(config: dict) -> bool:
    """DeepSeek-V3's latent, rope and head sizes, and a query LoRA."""
    return all(config.get(k) == v for k, v in DSV3_ATTENTION.items()) and bool(config.get("q_lora_rank"))


def prepare_model(path: str | None, workdir: Path) -> Path:
    """The checkpoint to serve: an existing one at `path`, or the benchmark model written there
    (or into `workdir`)."""
    out = Path(path) if path else workdir / "dsv3-attn-tiny"
    if (out / "config.json").is_file():
        config = json.loads((out / "config.json").read_text())
        if not has_dsv3_attention(config):
            print(
                f"warning: {out} does not have DeepSeek-V3's attention dimensions {DSV3_ATTENTION}; "
                "vLLM's CPU MLA kernels may refuse it",
                file=sys.stderr,
            )
        return out
    from afd_engine.tiny_model import make_tiny_model

    return make_tiny_model(out, arch="deepseek_v3", seed=0, overrides=BENCH_MODEL_OVERRIDES)
