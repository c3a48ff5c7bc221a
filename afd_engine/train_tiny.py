"""Trains the small default model: a DeepSeek-V3-shaped checkpoint that writes English-like text,
with a multi-token prediction (MTP) head for speculative decoding.

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

Then, with the main weights frozen as written (bfloat16), one MTP module is trained with
DeepSeek-V3's objective: the cross-entropy of token i+2 from the main model's last hidden state at
position i (before its final norm) and the embedding of token i+1 (afd_engine/models/mtp.py has
the equations). DeepSeek trains the module together with the main model; trained after it, on
the true tokens alone it learns to predict the text but drifts from the main model's own guesses,
which a draft has to match. So the cross-entropy against the main model's distribution of the same
token (its logits at position i+1) is mixed in, with weight ``--mtp-distill`` (0: DeepSeek's
objective alone). The module is plain torch around transformers' ``DeepseekV3DecoderLayer``; the
embedding and ``shared_head.head`` are frozen copies of the main model's embedding and lm_head. It
is saved as layer ``num_hidden_layers`` (``num_nextn_predict_layers: 1``), and the README gains its
held-out top-1 accuracy for token i+2 and its greedy acceptance proxy: how often its argmax equals
the main model's own argmax at the next position, the true text as context.

Command line: ``afd train-tiny OUT_DIR [--seed 0] [--minutes M] [--steps N] [--mtp-steps K]
[--mtp-distill W] [--threads T]`` trains both (``--mtp-steps 0``: the main model alone).
``afd train-tiny OUT_DIR --mtp-only [--from DIR]`` trains only a head, on the checkpoint in DIR
(default: OUT_DIR itself, updated in place): its main tensors are copied into OUT_DIR bit for bit,
a head it had is replaced.
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

from afd_engine.arg_errors import ArgumentParser
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
    mtp_steps: int = 1000  # the MTP head's optimizer steps after the main model's; 0: no head
    mtp_lr: float = 2e-3
    # weight of the MTP head's second target, the main model's own distribution of the same token
    # (one position later); 0 leaves DeepSeek-V3's objective alone
    mtp_distill: float = 0.5

    def lr_at(self, step: int, mtp: bool = False) -> float:
        """Linear warmup, then cosine decay to min_lr_ratio of the peak at the last step (of the
        main training, or with `mtp` of the head's)."""
        lr, steps = (self.mtp_lr, self.mtp_steps) if mtp else (self.lr, self.steps)
        if step < self.warmup_steps:
            return lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, steps - self.warmup_steps)
        return lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def load_topics() -> tuple[dict[str, str], dict[str, str]]:
    """(train, held-out) topic texts by name, from the running CPython's documentation."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    heldout = {n: topics[n] for i, n in enumerate(names) if i % HELDOUT_EVERY == 0}
    return {n: topics[n] for n in names if n not in heldout}, heldout


def heldout_text(heldout_topics: dict[str, str]) -> str:
    """The held-out topics as one text: what heldout.txt holds."""
    return "\n\n".join(text.strip() for text in heldout_topics.values()) + "\n"


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
    (out / "heldout.txt").write_text(heldout_text(heldout_topics), encoding="utf-8")

    samples = training_samples(train_topics)
    tokenizer = build_bpe_tokenizer(samples, cfg.vocab_size)
    info = write_tokenizer_files(out, tokenizer)
    config = build_tiny_config("deepseek_v3", info, overrides=MODEL_OVERRIDES, dtype="bfloat16")
    stream = token_stream(tokenizer, samples)  # [tokens]
    heldout = torch.tensor(tokenizer.encode(heldout_text(heldout_topics)).ids, dtype=torch.long)

    model = build_model(config, cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, cfg)
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
        loss_ema = _optimizer_step(opt, params, loss, loss_ema, bar)
        step += 1
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
    if cfg.mtp_steps:
        result["mtp"] = train_mtp(out, out, cfg, mtp_command(cfg))
    return result


def adamw(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )


@torch.inference_mode()
def _optimizer_step(opt, params, loss: torch.Tensor, loss_ema: float | None, bar) -> float:
    """One AdamW step on `loss` (gradients clipped to norm 1); returns the loss's moving average
    and shows it on the progress bar."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
    bar.update(1)
    bar.set_postfix(loss=f"{loss.item():.3f}", ema=f"{loss_ema:.3f}")
    return loss_ema


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

    save_file(checkpoint_tensors(model.state_dict()), str(out / "model.safetensors"), metadata={"format": "pt"})
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


def checkpoint_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state dict -> DeepSeek's checkpoint tensors: one per expert, bfloat16, the
    router bias in float32 as real checkpoints keep it."""
    tensors = {}
    for name, t in state.items():
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
            tensors[name] = t.float().contiguous()
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    return tensors


def state_dict_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of checkpoint_tensors, in float32: each layer's experts stacked back into
    transformers' [E, 2I, H] gate_up_proj and [E, H, I] down_proj."""
    state, experts = {}, {}
    for name, t in tensors.items():
        prefix, sep, rest = name.partition("mlp.experts.")
        if sep:  # rest: "{e}.gate_proj.weight"
            e, proj = rest.split(".")[:2]
            experts.setdefault(prefix + sep, {})[(int(e), proj)] = t.float()
        else:
            state[name] = t.float()
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        gate_up = [torch.cat((parts[(e, "gate_proj")], parts[(e, "up_proj")])) for e in range(n)]
        state[prefix + "gate_up_proj"] = torch.stack(gate_up)
        state[prefix + "down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
    return state


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


# -- the multi-token prediction head ---------------------------------------------------------------

MTP_README_HEADING = "## Multi-token prediction head"
_BLOCK_NAMES = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


class MTPModule(torch.nn.Module):
    """DeepSeek-V3's MTP module in training form (equations: afd_engine/models/mtp.py). Its tensors
    are the checkpoint's `model.layers.{num_hidden_layers}.*`, the decoder block's held under
    `block.`; the embedding and `shared_head.head` are frozen copies of the main model's, and
    `shared_head.norm` starts as the main model's final norm."""

    def __init__(self, config: dict, main) -> None:
        import copy

        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

        super().__init__()
        hf_config = hf_deepseek_config(config)
        # the same attention and experts code as the main model's layers
        hf_config._attn_implementation = main.config._attn_implementation
        hf_config._experts_implementation = main.config._experts_implementation
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.layer_id = hf_config.num_hidden_layers
        self.init_std = hf_config.initializer_range
        self.embed_tokens = copy.deepcopy(main.model.embed_tokens).requires_grad_(False)
        self.enorm = hf.DeepseekV3RMSNorm(hidden, eps)
        self.hnorm = hf.DeepseekV3RMSNorm(hidden, eps)
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        # its layer id decides dense or MoE as for the engine's MTP layer
        self.block = hf.DeepseekV3DecoderLayer(hf_config, self.layer_id)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = copy.deepcopy(main.model.norm)
        self.shared_head.head = copy.deepcopy(main.lm_head).requires_grad_(False)
        self.rotary = hf.DeepseekV3RotaryEmbedding(hf_config)  # buffers only, none of them saved

    def reset_parameters(self, seed: int) -> None:
        """Draw the glue and the block from `seed` as transformers initialises a model: matrices
        normal(0, initializer_range), norms one, the router bias zero."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in (self.enorm, self.hnorm, self.eh_proj, self.block):
                for p in module.parameters():
                    if p.dim() >= 2:
                        p.normal_(0.0, self.init_std, generator=gen)
                    else:
                        p.fill_(1.0)
            if hasattr(self.block.mlp, "gate"):
                self.block.mlp.gate.e_score_correction_bias.zero_()

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H]: the main model's last hidden state at positions 0..T-1, before its
        final norm; next_ids [B, T]: the token after each position. Returns logits [B, T, V] of
        the token after that."""
        x = self.eh_proj(torch.cat((self.enorm(self.embed_tokens(next_ids)), self.hnorm(hidden)), dim=-1))
        positions = torch.arange(x.shape[1])[None]
        x = self.block(
            x,
            attention_mask=None,
            position_ids=positions,
            position_embeddings=self.rotary(x, positions),
            is_causal=True,
        )
        return self.shared_head.head(self.shared_head.norm(x))

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The state dict under the checkpoint's names, transformers' expert layout."""
        prefix = f"model.layers.{self.layer_id}."
        return {prefix + name.removeprefix("block."): t for name, t in self.state_dict().items()}

    def load_checkpoint(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load this layer's tensors from a checkpoint's (DeepSeek's layout)."""
        prefix = f"model.layers.{self.layer_id}."
        own = {n.removeprefix(prefix): t for n, t in state_dict_tensors(tensors).items() if n.startswith(prefix)}
        self.load_state_dict({("block." + n if n.startswith(_BLOCK_NAMES) else n): t for n, t in own.items()})


def layer_of(name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to (None: the embedding, final norm, lm_head)."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


def hf_deepseek_config(config: dict):
    """transformers' DeepseekV3Config of a config.json dict, which it leaves as it was (the config
    class fills in the nested rope settings it is handed)."""
    import copy

    from transformers import DeepseekV3Config

    return DeepseekV3Config(**copy.deepcopy(config))


def load_checkpoint(path: str | pathlib.Path):
    """(config, every tensor as stored, the main model in float32 with its weights frozen) of a
    checkpoint directory; an MTP module it holds is left out of the model."""
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    path = pathlib.Path(path)
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    tensors = load_file(str(path / "model.safetensors"))
    n = config["num_hidden_layers"]
    main_tensors = {k: t for k, t in tensors.items() if (layer_of(k) or 0) < n}
    model = DeepseekV3ForCausalLM(hf_deepseek_config(config))
    model.load_state_dict(state_dict_tensors(main_tensors))
    return config, tensors, model.requires_grad_(False).eval()


def main_forward(main, ids: torch.Tensor, logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The main model's last hidden state before its final norm [B, T, H] (what the MTP module
    reads), and with `logits` its logits [B, T, V]."""
    seen = []
    hook = main.model.norm.register_forward_hook(lambda _module, args, _out: seen.append(args[0]))
    try:
        if logits:
            out = main(input_ids=ids).logits
        else:  # the model without its lm_head
            main.model(input_ids=ids)
            out = None
    finally:
        hook.remove()
    return seen[0], out


def train_mtp(src_dir: str | pathlib.Path, out_dir: str | pathlib.Path, cfg: TrainConfig, command: str) -> dict:
    """Train an MTP head on the checkpoint in src_dir (its main weights frozen) for cfg.mtp_steps
    steps, write the checkpoint with the head into out_dir (src_dir itself is fine; the main tensors
    copied bit for bit, a head src_dir had replaced) and return the run's numbers. `command` is
    what the README says produced it."""
    from tokenizers import Tokenizer
    from tqdm import tqdm

    torch.set_num_threads(cfg.threads)
    src, out = pathlib.Path(src_dir), pathlib.Path(out_dir)
    config, tensors, main = load_checkpoint(src)
    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    train_topics, heldout_topics = load_topics()
    stream = token_stream(tokenizer, training_samples(train_topics))  # [tokens]
    heldout = torch.tensor(tokenizer.encode(heldout_text(heldout_topics)).ids, dtype=torch.long)

    mtp = MTPModule(config, main)
    mtp.reset_parameters(cfg.seed)
    params = [p for p in mtp.parameters() if p.requires_grad]
    opt = adamw(params, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    start, step, loss_ema, T = time.monotonic(), 0, None, cfg.seq_len
    bar = tqdm(total=cfg.mtp_steps, desc="train-tiny mtp", unit="step")
    while step < cfg.mtp_steps and time.monotonic() - start < cfg.minutes * 60:
        starts = torch.randint(0, len(stream) - T - 1, (cfg.batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + T + 2] for s in starts.tolist()])  # [B, T+2]
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step, mtp=True)
        with torch.no_grad():  # positions 0 .. T: the hidden states of 0 .. T-1, the logits of 1 .. T
            hidden, main_logits = main_forward(main, batch[:, : T + 1], logits=cfg.mtp_distill > 0)
        logits = mtp(hidden[:, :T], batch[:, 1 : T + 1]).flatten(0, 1)  # [B*T, V]: token i+2 from h_i, token i+1
        loss = torch.nn.functional.cross_entropy(logits, batch[:, 2:].flatten())
        if cfg.mtp_distill > 0:
            main_probs = main_logits[:, 1:].flatten(0, 1).softmax(-1)
            distill = torch.nn.functional.cross_entropy(logits, main_probs)
            loss = (1 - cfg.mtp_distill) * loss + cfg.mtp_distill * distill
        loss_ema = _optimizer_step(opt, params, loss, loss_ema, bar)
        step += 1
    bar.close()
    minutes = (time.monotonic() - start) / 60
    with torch.no_grad():  # measure what the checkpoint will hold
        for p in params:
            p.copy_(p.to(torch.bfloat16))
    mtp.eval()
    result = {
        "steps": step,
        "minutes": round(minutes, 1),
        "train_loss": round(loss_ema, 3) if loss_ema is not None else None,
        **mtp_metrics(main, mtp, heldout, T),
        "command": command,
    }
    save_mtp_checkpoint(src, out, config, tensors, mtp)
    readme = src / "README.md"
    base = readme.read_text(encoding="utf-8") if readme.exists() else ""
    write_mtp_readme(out, base, cfg, result, mtp.layer_id)
    return result


@torch.inference_mode()
def mtp_metrics(main, mtp: MTPModule, ids: torch.Tensor, seq_len: int, batch_size: int = 8) -> dict:
    """On consecutive windows of the held-out stream, the true text as context: `mtp_top1`, how
    often the head's argmax is token i+2; `acceptance`, how often it is the main model's own argmax
    at position i+1 (the greedy acceptance of a one-token draft); `main_top1`, the main model's
    accuracy on the same tokens one position later; `predictions`."""
    starts = range(0, len(ids) - 2, seq_len - 1)  # each window predicts tokens s+2 .. s+seq_len
    by_length: dict[int, list[torch.Tensor]] = {}  # all windows full but the last
    for s in starts:
        window = ids[s : s + seq_len + 1]
        if len(window) >= 3:
            by_length.setdefault(len(window), []).append(window)
    hits = agree = main_hits = count = 0
    for same in by_length.values():
        for i in range(0, len(same), batch_size):
            window = torch.stack(same[i : i + batch_size])  # [B, L]
            hidden, logits = main_forward(main, window[:, :-1], logits=True)  # positions 0 .. L-2
            draft = mtp(hidden[:, :-1], window[:, 1:-1]).argmax(-1)  # [B, L-2]: token i+2 at position i
            main_next = logits[:, 1:].argmax(-1)  # the main model's token i+2, from position i+1
            hits += (draft == window[:, 2:]).sum().item()
            agree += (draft == main_next).sum().item()
            main_hits += (main_next == window[:, 2:]).sum().item()
            count += draft.numel()
    return {
        "mtp_top1": round(hits / count, 4),
        "acceptance": round(agree / count, 4),
        "main_top1": round(main_hits / count, 4),
        "predictions": count,
    }


def save_mtp_checkpoint(
    src: pathlib.Path, out: pathlib.Path, config: dict, tensors: dict[str, torch.Tensor], mtp: MTPModule
) -> None:
    """Write src's checkpoint with `mtp` as its one MTP module into out: the main tensors as read,
    the module's in DeepSeek's layout, config.json declaring it; src's other files copied."""
    import os
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != src.resolve():
        for f in src.iterdir():
            if f.is_file() and f.name not in ("model.safetensors", "config.json", "README.md"):
                shutil.copyfile(f, out / f.name)
    main_tensors = {k: t for k, t in tensors.items() if (layer_of(k) or 0) < mtp.layer_id}
    tmp = out / "model.safetensors.tmp"  # src's file may be this one, still mapped
    save_file({**main_tensors, **checkpoint_tensors(mtp.checkpoint_state())}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    _write_json(out / "config.json", {**config, "num_nextn_predict_layers": 1})


def write_mtp_readme(out: pathlib.Path, base: str, cfg: TrainConfig, result: dict, layer_id: int) -> None:
    """The main model's README (without an older MTP section) and a section on the head."""
    base = base.split(MTP_README_HEADING)[0].strip()
    text = f"""{base + chr(10) * 2 if base else ""}{MTP_README_HEADING}

`model.layers.{layer_id}.*` (`num_nextn_predict_layers: 1`) is a DeepSeek-V3 multi-token
prediction module, the draft of speculative decoding: an MLA + MoE decoder block and its glue that
predict token i+2 from the main model's last hidden state at position i and the embedding of token
i+1. It was trained after the main model, whose weights stay bit for bit as above, for
{result["minutes"]} minutes on the CPU on the same text: DeepSeek-V3's objective (the cross-entropy of
token i+2) mixed, with weight {cfg.mtp_distill}, with the cross-entropy against the main model's own
distribution of that token (at position i+1), which a draft has to match. Its embedding and
`shared_head.head` are frozen copies of the main model's.

- Command: `{result["command"]}`:
  seed {cfg.seed}, {result["steps"]} steps of {cfg.batch_size} x {cfg.seq_len} tokens, AdamW, lr {cfg.mtp_lr} with
  warmup and cosine decay. `afd train-tiny` without `--mtp-only` trains the head this way after
  the main model.
- Final train loss (moving average): {result["train_loss"]}.
- On heldout.txt ({result["predictions"]} predictions, the true text as context): top-1 accuracy
  for token i+2: {result["mtp_top1"]} (the main model's on the same tokens, one position later:
  {result["main_top1"]}). Greedy acceptance proxy (how often the head's argmax is the main model's
  own argmax at the next position): {result["acceptance"]}.
- Weights in bfloat16 (the router bias in float32, zero). Date: 2026-11-28.
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def mtp_command(cfg: TrainConfig) -> str:
    """The command that trains cfg's MTP head on the main checkpoint in OUT_DIR."""
    return (
        f"afd train-tiny OUT_DIR --mtp-only --seed {cfg.seed} --mtp-steps {cfg.mtp_steps} "
        f"--mtp-distill {cfg.mtp_distill} --threads {cfg.threads}"
    )


def build_train_tiny_parser() -> argparse.ArgumentParser:
    defaults = TrainConfig()
    parser = ArgumentParser(
        prog="afd train-tiny",
        description="Train the small default model on CPU, then its multi-token prediction (MTP) head.",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the init and of the batches")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps (the lr schedule's length)")
    parser.add_argument(
        "--mtp-steps",
        type=int,
        default=defaults.mtp_steps,
        help="optimizer steps of the MTP head, trained after the main model (0: no head)",
    )
    parser.add_argument(
        "--mtp-distill",
        type=float,
        default=defaults.mtp_distill,
        help="weight of the MTP head's second target, the main model's own distribution of the same token "
        "(0: DeepSeek-V3's cross-entropy alone)",
    )
    parser.add_argument(
        "--mtp-only",
        action="store_true",
        help="train only the MTP head, on the checkpoint in --from: its main tensors are copied into OUT_DIR "
        "bit for bit, a head it had is replaced",
    )
    parser.add_argument(
        "--from",
        dest="from_dir",
        metavar="DIR",
        help="with --mtp-only: the checkpoint to add the head to (default: OUT_DIR, updated in place)",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=defaults.minutes,
        help="stop each training (main, head) earlier after this long",
    )
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch CPU threads")
    return parser


def main_train_tiny(argv: list[str]) -> int:
    """Command-line entry: train into OUT_DIR and print the run's numbers as JSON."""
    parser = build_train_tiny_parser()
    args = parser.parse_args(argv)
    if args.from_dir and not args.mtp_only:
        parser.error("--from reads the checkpoint that --mtp-only adds a head to: give --mtp-only too")
    if args.mtp_only and args.mtp_steps < 1:
        parser.error("--mtp-only trains the MTP head: --mtp-steps must be at least 1")
    if not 0 <= args.mtp_distill <= 1:
        parser.error(f"--mtp-distill is a weight between 0 and 1, not {args.mtp_distill}")
    cfg = TrainConfig(
        seed=args.seed,
        steps=args.steps,
        mtp_steps=args.mtp_steps,
        mtp_distill=args.mtp_distill,
        minutes=args.minutes,
        threads=args.threads,
    )
    if args.mtp_only:
        result = train_mtp(args.from_dir or args.out_dir, args.out_dir, cfg, mtp_command(cfg))
    else:
        result = train(args.out_dir, cfg)
    print(json.dumps(result))
    return 0


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main_train_tiny(sys.argv[1:]))
