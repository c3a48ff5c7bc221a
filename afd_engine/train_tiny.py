"""Trains the small default model: a DeepSeek-V3-shaped checkpoint that writes English-like text.

The text is CPython's own documentation, `pydoc_data.topics.topics` (about 80 topics, ~465k
characters, shipped with every CPython under the PSF License Version 2), so training needs no
download. Every eighth topic in sorted order is held out and written as ``heldout.txt`` for the
perplexity. A byte-level BPE tokenizer with the tiny tokenizer's special tokens and chat template
is trained on the rest, which is also wrapped into chat samples (a question about the topic as the
user turn, a passage as the assistant turn) so that chat prompts lead to prose.

The model is transformers' own ``DeepseekV3ForCausalLM`` (MLA with q_lora, a dense first layer,
shared and routed experts with sigmoid group-limited routing). The router's
``e_score_correction_bias`` gets no gradient and stays zero. Batches are random windows of the
token stream drawn from a seeded generator, so the same seed and step count give the same weights.
The checkpoint is written in DeepSeek's layout (one tensor per expert) with bfloat16 weights.

Command line: ``afd train-tiny OUT_DIR [--seed 0] [--minutes M] [--steps N] [--threads T]``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from dataclasses import dataclass

import torch

from afd_engine.tiny_model import build_tiny_config
from afd_engine.tiny_tokenizer import ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, USER_TOKEN, build_bpe_tokenizer

HELDOUT_EVERY = 8  # topics 0, 8, 16, ... of the sorted topic names are held out

# Size of the model, as config.json overrides of the tiny deepseek_v3 preset.
MODEL_OVERRIDES = {
    "hidden_size": 192,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
}

QUESTIONS = ("Tell me about {}.", "What is {} in Python?", "Explain {}.", "How does {} work?")


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run; the defaults are those of the shipped checkpoint."""

    seed: int = 0
    steps: int = 600
    minutes: float = 40.0
    threads: int = 2
    vocab_size: int = 2048
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine decay to min_lr_ratio * lr at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def load_topics() -> tuple[dict[str, str], dict[str, str]]:
    """(train, held-out) topic texts by name, from the running CPython's documentation."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    heldout = {n: topics[n] for i, n in enumerate(names) if i % HELDOUT_EVERY == 0}
    return {n: topics[n] for n in names if n not in heldout}, heldout


def passages(text: str, max_chars: int = 1200) -> list[str]:
    """Split a topic into runs of whole paragraphs of at most ~max_chars characters."""
    out, cur = [], ""
    for para in text.strip().split("\n\n"):
        if cur and len(cur) + len(para) > max_chars:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    return out + ([cur] if cur else [])


def training_samples(topics: dict[str, str]) -> list[str]:
    """Every passage as plain text; every passage also as a chat turn (question, then the passage)."""
    samples = []
    for t, (name, text) in enumerate(topics.items()):
        title = name.replace("-", " ")
        for p, passage in enumerate(passages(text)):
            question = QUESTIONS[(t + p) % len(QUESTIONS)].format(title)
            samples.append(f"{BOS_TOKEN}{passage}{EOS_TOKEN}")
            samples.append(f"{BOS_TOKEN}{USER_TOKEN}{question}{ASSISTANT_TOKEN}{passage}{EOS_TOKEN}")
    return samples


def token_stream(tokenizer, samples: list[str]) -> torch.Tensor:
    # The samples spell their own bos, so the post-processor's is left out.
    ids = [i for s in samples for i in tokenizer.encode(s, add_special_tokens=False).ids]
    return torch.tensor(ids, dtype=torch.long)


def build_model(config: dict, seed: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**config))
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.e_score_correction_bias.zero_()
    return model


def train(out_dir: str | pathlib.Path, cfg: TrainConfig) -> dict:
    """Train, write the checkpoint and its README into out_dir, and return the run's numbers."""
    from tqdm import tqdm

    from afd_engine.tiny_tokenizer import write_tokenizer_files

    torch.set_num_threads(cfg.threads)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_topics, heldout_topics = load_topics()
    heldout_text = "\n\n".join(heldout_topics[n].strip() for n in heldout_topics) + "\n"
    (out / "heldout.txt").write_text(heldout_text, encoding="utf-8")

    samples = training_samples(train_topics)
    tokenizer = build_bpe_tokenizer(samples, cfg.vocab_size)
    info = write_tokenizer_files(out, tokenizer)
    config = build_tiny_config("deepseek_v3", info, overrides=MODEL_OVERRIDES, dtype="bfloat16")
    stream = token_stream(tokenizer, samples)  # [tokens]
    heldout = torch.tensor(tokenizer.encode(heldout_text).ids, dtype=torch.long)

    model = build_model(config, cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    start, step, loss_ema = time.monotonic(), 0, None
    bar = tqdm(total=cfg.steps, desc="train-tiny", unit="step")
    model.train()
    while step < cfg.steps and time.monotonic() - start < cfg.minutes * 60:
        starts = torch.randint(0, len(stream) - cfg.seq_len, (cfg.batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + cfg.seq_len] for s in starts.tolist()])  # [B, T]
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", ema=f"{loss_ema:.3f}")
    bar.close()
    minutes = (time.monotonic() - start) / 60
    model.eval()
    result = {
        "steps": step,
        "minutes": round(minutes, 1),
        "train_loss": round(loss_ema, 3),
        "heldout_ppl": round(perplexity(model, heldout, cfg.seq_len), 2),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": len(stream),
        "heldout_tokens": len(heldout),
    }
    save_checkpoint(model, config, out)
    write_readme(out, cfg, result, sorted(heldout_topics))
    return result


@torch.inference_mode()
def perplexity(model, ids: torch.Tensor, seq_len: int) -> float:
    """exp(mean next-token loss) over consecutive windows of the held-out stream."""
    total, count = 0.0, 0
    for s in range(0, len(ids) - 1, seq_len):
        window = ids[s : s + seq_len + 1][None]  # [1, <= T+1]
        if window.shape[1] < 2:
            break
        logits = model(input_ids=window[:, :-1]).logits[0]  # [T, V]
        total += torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum").item()
        count += window.shape[1] - 1
    return math.exp(total / count)


def save_checkpoint(model, config: dict, out: pathlib.Path) -> None:
    """Write model.safetensors with DeepSeek's names (one tensor per expert), config and generation config."""
    from safetensors.torch import save_file

    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            prefix = name[: -len("gate_up_proj")]
            gates, ups = t.chunk(2, dim=1)  # [E, I, H] each
            for e, (gate, up) in enumerate(zip(gates, ups)):
                tensors[f"{prefix}{e}.gate_proj.weight"] = gate.to(torch.bfloat16).contiguous()
                tensors[f"{prefix}{e}.up_proj.weight"] = up.to(torch.bfloat16).contiguous()
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            prefix = name[: -len("down_proj")]
            for e, down in enumerate(t.unbind(0)):
                tensors[f"{prefix}{e}.down_proj.weight"] = down.to(torch.bfloat16).contiguous()
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = t.float().contiguous()  # real checkpoints keep the router bias in float32
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {  # the server's defaults for requests that set no temperature / top_p: a tiny model's
            # text at temperature 1 breaks words apart
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.9,
        },
    )


def write_readme(out: pathlib.Path, cfg: TrainConfig, result: dict, heldout_names: list[str]) -> None:
    import platform

    experts, topk = MODEL_OVERRIDES["n_routed_experts"], MODEL_OVERRIDES["num_experts_per_tok"]
    text = f"""# tiny-deepseek-v3-pydoc

A {result["parameters"] / 1e6:.1f}-million-parameter DeepSeek-V3-shaped model (`DeepseekV3ForCausalLM`: MLA with
q_lora, a dense first layer, then {experts} routed experts, top-{topk},
with sigmoid group-limited routing, and a shared expert), trained on the CPU for {result["minutes"]} minutes on
Python's documentation. It writes English-like text about Python, not correct answers.

- Training text: `pydoc_data.topics.topics` of CPython {platform.python_version()} (the text of the `help()`
  topics), PSF License Version 2. Held out for perplexity, every {HELDOUT_EVERY}th topic in sorted order
  (`heldout.txt`): {", ".join(heldout_names)}.
- Tokenizer: byte-level BPE of {cfg.vocab_size} tokens trained on the training text, with DeepSeek-V3's
  special tokens (ids 0..4) and chat template.
- Command: `afd train-tiny OUT_DIR --seed {cfg.seed} --steps {cfg.steps} --threads {cfg.threads}`: seed {cfg.seed},
  {result["steps"]} steps of {cfg.batch_size} x {cfg.seq_len} tokens, AdamW, lr {cfg.lr} with warmup and
  cosine decay, {result["train_tokens"]} training tokens. The same seed, steps and CPython version give
  the same files.
- Final train loss (moving average): {result["train_loss"]}. Held-out perplexity: {result["heldout_ppl"]}
  ({result["heldout_tokens"]} tokens).
- Weights in bfloat16 (the router bias in float32, zero). Date: 2026-11-23.
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def build_train_tiny_parser() -> argparse.ArgumentParser:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(prog="afd train-tiny", description="Train the small default model on CPU.")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the init and of the batches")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps (the lr schedule's length)")
    parser.add_argument("--minutes", type=float, default=defaults.minutes, help="stop earlier after this long")
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch CPU threads")
    return parser


def main_train_tiny(argv: list[str]) -> int:
    """Command-line entry: train into OUT_DIR and print the run's numbers as JSON."""
    args = build_train_tiny_parser().parse_args(argv)
    cfg = TrainConfig(seed=args.seed, steps=args.steps, minutes=args.minutes, threads=args.threads)
    print(json.dumps(train(args.out_dir, cfg)))
    return 0


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main_train_tiny(sys.argv[1:]))
