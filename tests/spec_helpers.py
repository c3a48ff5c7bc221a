"""A checkpoint whose MTP module is a "copy" drafter, for speculative decoding tests across processes.

Its block adds nothing (attention and expert outputs zeroed), its projection passes the next
token's normalised embedding through and its head is the embedding, so it proposes the last token
again. The tiny model's greedy output ends in runs of one repeated token, where those drafts are
accepted; elsewhere they are rejected. The module still runs every pass (attention over its cache,
its MoE wherever its experts are placed)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from afd_engine.tiny_model import make_tiny_model

# prompts whose greedy continuation on the copy drafter's checkpoint repeats tokens (the first)
PROMPTS = [[11] * 20, [5, 9, 33, 12, 7], [4, 8, 15, 16, 23, 42, 17, 3], [30, 41, 7] * 6]


def make_copy_drafter(out: Path) -> str:
    path = make_tiny_model(out, arch="deepseek_v3", seed=4, overrides={"num_nextn_predict_layers": 1})
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    (file,) = path.glob("*.safetensors")
    w = load_file(str(file))
    p = f"model.layers.{n}."
    for name in list(w):
        if name.startswith(p) and (name.endswith("o_proj.weight") or name.endswith("down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    h = w[p + "eh_proj.weight"].shape[0]
    w[p + "eh_proj.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1).to(w[p + "eh_proj.weight"].dtype)
    w[p + "shared_head.head.weight"] = w["model.embed_tokens.weight"].clone()
    save_file(w, str(file))
    return str(path)
