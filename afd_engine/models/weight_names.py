"""Checkpoint tensor names that differ from the engine's module names, per architecture.

The engine's modules carry DeepSeek's names: the MoE block is `mlp`, its router `mlp.gate` holds the
correction bias, its experts' projections are `gate_proj`, `up_proj` and `down_proj`. MiniMax-M2's
checkpoints (the published ones, and what transformers' save_pretrained writes) name the block
`block_sparse_moe`, keep the correction bias on the block rather than on its router, and name the
experts' projections `w1` (gate), `w3` (up) and `w2` (down). The loader reads a checkpoint name as
the module name `module_name` gives; the checkpoint inspection expects `checkpoint_name` of each
module tensor.
"""

from __future__ import annotations

import re

_LAYER = r"^(model\.layers\.\d+)\."
# (checkpoint pattern, module replacement), (module pattern, checkpoint replacement)
_MINIMAX_M2 = (
    (_LAYER + r"block_sparse_moe\.e_score_correction_bias$", r"\1.mlp.gate.e_score_correction_bias"),
    (_LAYER + r"block_sparse_moe\.gate\.weight$", r"\1.mlp.gate.weight"),
    (_LAYER + r"block_sparse_moe\.experts\.(\d+)\.w1\.weight$", r"\1.mlp.experts.\2.gate_proj.weight"),
    (_LAYER + r"block_sparse_moe\.experts\.(\d+)\.w3\.weight$", r"\1.mlp.experts.\2.up_proj.weight"),
    (_LAYER + r"block_sparse_moe\.experts\.(\d+)\.w2\.weight$", r"\1.mlp.experts.\2.down_proj.weight"),
)
_TO_CHECKPOINT = (
    (_LAYER + r"mlp\.gate\.e_score_correction_bias$", r"\1.block_sparse_moe.e_score_correction_bias"),
    (_LAYER + r"mlp\.gate\.weight$", r"\1.block_sparse_moe.gate.weight"),
    (_LAYER + r"mlp\.experts\.(\d+)\.gate_proj\.weight$", r"\1.block_sparse_moe.experts.\2.w1.weight"),
    (_LAYER + r"mlp\.experts\.(\d+)\.up_proj\.weight$", r"\1.block_sparse_moe.experts.\2.w3.weight"),
    (_LAYER + r"mlp\.experts\.(\d+)\.down_proj\.weight$", r"\1.block_sparse_moe.experts.\2.w2.weight"),
)

_RENAMES = {
    "MiniMaxM2ForCausalLM": (
        tuple((re.compile(p), r) for p, r in _MINIMAX_M2),
        tuple((re.compile(p), r) for p, r in _TO_CHECKPOINT),
    )
}


def module_name(architecture: str, name: str) -> str:
    """The engine's name of the checkpoint tensor `name` (unchanged where the two agree)."""
    return _rename(_RENAMES.get(architecture, ((), ()))[0], name)


def checkpoint_name(architecture: str, name: str) -> str:
    """The checkpoint's name of the engine tensor `name` (one tensor per expert projection)."""
    return _rename(_RENAMES.get(architecture, ((), ()))[1], name)


def _rename(rules, name: str) -> str:
    for pattern, replacement in rules:
        renamed, hits = pattern.subn(replacement, name)
        if hits:
            return renamed
    return name
