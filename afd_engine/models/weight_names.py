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

# (checkpoint name, module name) within a layer; `E` stands for an expert's index
_MINIMAX_M2 = (
    ("block_sparse_moe.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
    ("block_sparse_moe.gate.weight", "mlp.gate.weight"),
    ("block_sparse_moe.experts.E.w1.weight", "mlp.experts.E.gate_proj.weight"),
    ("block_sparse_moe.experts.E.w3.weight", "mlp.experts.E.up_proj.weight"),
    ("block_sparse_moe.experts.E.w2.weight", "mlp.experts.E.down_proj.weight"),
)


def _rules(pairs, forward: bool) -> tuple:
    """Compiled (pattern, replacement) rules renaming one side of `pairs` to the other."""

    def pattern(name: str) -> re.Pattern:
        return re.compile(r"^(model\.layers\.\d+)\." + re.escape(name).replace("E", r"(\d+)") + "$")

    def replacement(name: str) -> str:
        return r"\1." + name.replace("E", r"\2")

    return tuple((pattern(a), replacement(b)) for a, b in (pairs if forward else [(m, c) for c, m in pairs]))


_RENAMES = {"MiniMaxM2ForCausalLM": (_rules(_MINIMAX_M2, True), _rules(_MINIMAX_M2, False))}


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
