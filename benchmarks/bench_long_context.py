#!/usr/bin/env python3
"""Decode step time against context length: DeepSeek-V3.2's sparse attention against the same model dense.

Two checkpoints of one shape, written with the same seed: a DeepSeek-V3.2 one (`deepseek_v32`, its
lightning indexer choosing `index_topk` cached tokens per query, models/indexer.py) and a
DeepSeek-V3 one (`deepseek_v3`) whose tensors are the same ones without the indexer's, so the dense
model is exactly the sparse one with its plain MLA decode (every cached token) in place of the
indexer and the sparse MLA kernel.

Contexts are not prefilled: for each length L, B sequences get a pool row of L cached tokens whose
rows are what each layer's own projections make of random hidden states (normalised latent, roped
k_pe, LayerNorm'd and roped index key), the same rows in both models. Every context is built before
any is timed; then each of `--repeats` rounds times one decode step (B new tokens at position L,
the model's forward only) of each context and model in turn, so that a slow phase of a shared
machine falls on all of them; figures are medians over the rounds. The attention parts are timed
inside those steps, summed over the layers: the indexer modules, and the MLA kernel calls (sparse
MLA, or dense decode).

The untimed step also checks what is measured: how many tokens each query's MLA attended to (the
sparse model: min(L + 1, index_topk); dense: L + 1), and the largest difference between the two
models' logits (float rounding wherever L + 1 <= index_topk, where the indexer keeps everything).

Each attention backend runs in turn (default: "cpu", the engine's, whose dense decode is a C kernel
while sparse MLA is torch code; and "torch", the reference of both).

    python -m benchmarks.bench_long_context [--contexts 1024 2048 ...] [--batch 4] [--repeats 21] \
        [--backends cpu torch] [--json out.json] [--plot out.png] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from afd_engine import Engine
from afd_engine.models.forward_batch import ForwardBatch, SeqChunk
from afd_engine.tiny_model import make_tiny_model
from benchmarks.lib.results import write_json

CONTEXTS = (1024, 2048, 4096, 8192, 16384)
QUICK_CONTEXTS = (16, 64, 128)
INDEXER_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
# DeepSeek-V3's rope (YaRN to 160K positions): every context measured is a valid position.
ROPE = {
    "max_position_embeddings": 163840,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
# V3.2's attention scaled down (latent and head dims to a quarter or half, heads to an eighth:
# twice as many MLA heads as indexer heads, as there) with its own index_topk, and a small MoE, so
# that attention is a visible share of a step on a CPU.
SHAPES = {
    "hidden_size": 256,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 128,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "q_lora_rank": 192,
    "index_n_heads": 8,
    "index_head_dim": 64,
    "index_topk": 2048,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
}
QUICK_SHAPES = {"index_topk": 32}  # the tiny preset otherwise
MODELS = ("dense", "sparse")
PAGE = 16  # both engines' page size


class PartTimer:
    """Times a model's attention parts inside its steps: the indexer modules (forward hooks) and
    the MLA kernel calls (the backend's `sparse` and `decode`, wrapped), summed over the layers.
    While `checking`, it also records how many tokens each MLA call's queries attended to."""

    def __init__(self, model) -> None:
        self.seconds = {"indexer": 0.0, "mla": 0.0}
        self.checking = False
        self.attended: list[torch.Tensor] = []
        kernels = model.model.layers[0].self_attn.kernels  # one backend object, shared by the layers
        kernels.sparse = self._timed(kernels.sparse, lambda args: (args[3] >= 0).sum(-1))
        kernels.decode = self._timed(kernels.decode, lambda args: args[3].kv_lens)
        for layer in model.served_layers:
            indexer = layer.self_attn.indexer
            if indexer is not None:
                indexer.register_forward_pre_hook(self._start)
                indexer.register_forward_hook(self._stop)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def _start(self, module, args) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, module, args, out) -> None:
        self.seconds["indexer"] += time.perf_counter() - self._t0

    def _timed(self, kernel, attended):
        def call(*args):
            t0 = time.perf_counter()
            out = kernel(*args)
            self.seconds["mla"] += time.perf_counter() - t0
            if self.checking:
                self.attended.append(attended(args))
            return out

        return call


def write_models(out: Path, quick: bool) -> dict[str, Path]:
    """The sparse checkpoint and the dense one: same seed, same names, so the same shared tensors."""
    shapes = {**ROPE, **(QUICK_SHAPES if quick else SHAPES)}
    dense = {k: v for k, v in shapes.items() if k not in INDEXER_KEYS}
    return {
        "sparse": make_tiny_model(out / "sparse", arch="deepseek_v32", overrides=shapes),
        "dense": make_tiny_model(out / "dense", arch="deepseek_v3", overrides=dense),
    }


def row_slots(pool, row: int, tokens: int) -> torch.Tensor:
    """The cache slots of a row's first `tokens` tokens."""
    t = torch.arange(tokens)
    return pool.page_table[row, t // pool.page_size] * pool.page_size + t % pool.page_size


@torch.inference_mode()
def fill_context(engines: dict, rows: dict, context: int, gen: torch.Generator) -> None:
    """Writes `context` tokens into every row of both models: per layer and sequence, the cache
    rows the sparse model's projections make of random hidden states at positions 0..context-1."""
    model = engines["sparse"].model
    cfg = model.config
    cos, sin = model.model.rotary.cos_sin(torch.arange(context), torch.float32)
    for layer in model.served_layers:
        attn, i = layer.self_attn, layer.layer_id
        for seq in range(len(rows["sparse"])):
            x = layer.input_layernorm(torch.randn(context, cfg.hidden_size, generator=gen))
            latent, k_pe = attn.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
            mla = torch.cat((attn.kv_a_layernorm(latent), attn.rotary.apply(k_pe, cos, sin)), dim=-1)
            index_key = attn.indexer._rope(attn.indexer.k_norm(attn.indexer.wk(x)), cos, sin)
            for name, engine in engines.items():
                pool = engine.pool
                slots = row_slots(pool, rows[name][seq], context)
                pool.cache[i, slots, : cfg.mla_cache_dim] = mla
                if name == "sparse":
                    pool.cache[i, slots, cfg.mla_cache_dim :] = index_key


class Context:
    """One context length, built in both models: B pool rows of `context` cached tokens each, and
    the decode step that adds one token to each."""

    def __init__(self, engines: dict, context: int, batch: int, gen: torch.Generator) -> None:
        self.context, self.engines = context, engines
        self.rows = {name: [e.pool.open_row() for _ in range(batch)] for name, e in engines.items()}
        for name, engine in engines.items():
            for row in self.rows[name]:
                assert engine.pool.grow(row, context + 1), "the KV pool is too small for this context"
        fill_context(engines, self.rows, context, gen)
        tokens = torch.randint(5, engines["sparse"].config.vocab_size, (batch,), generator=gen).tolist()
        self.batches = {
            name: ForwardBatch.build(
                [], [SeqChunk(r, context, [t]) for r, t in zip(self.rows[name], tokens)], e.pool.page_table, PAGE
            )
            for name, e in engines.items()
        }
        self.logit_rows = torch.arange(batch)
        self.samples = {name: {"step_ms": [], "indexer_ms": [], "mla_ms": []} for name in MODELS}
        self.attended: dict[str, dict] = {}  # model -> fewest and most tokens a query attended to

    def step(self, name: str) -> torch.Tensor:
        engine = self.engines[name]
        return engine.model(self.batches[name], engine.pool.cache, self.logit_rows)

    def check(self, timers: dict) -> dict:
        """The untimed step (a warm-up too): how many tokens each model's MLA attended to per query,
        and the largest difference of the two models' logits."""
        logits, attended = {}, {}
        for name, timer in timers.items():
            timer.checking, timer.attended = True, []
            logits[name] = self.step(name)
            timer.checking = False
            counts = torch.cat(timer.attended)
            attended[name] = {"min": int(counts.min()), "max": int(counts.max())}
        self.attended = attended
        return {"logits_max_abs_diff": (logits["sparse"] - logits["dense"]).abs().max().item()}

    def time(self, timers: dict) -> None:
        """One timed step of each model, its attention parts with it."""
        for name, timer in timers.items():
            timer.reset()
            t0 = time.perf_counter()
            self.step(name)
            self.samples[name]["step_ms"].append(1000 * (time.perf_counter() - t0))
            for part, seconds in timer.seconds.items():
                self.samples[name][f"{part}_ms"].append(1000 * seconds)

    def result(self, checked: dict) -> dict:
        out = {"context": self.context, **checked}
        for name in MODELS:
            parts = {k: v for k, v in self.samples[name].items() if name == "sparse" or k != "indexer_ms"}
            medians = {k: statistics.median(v) for k, v in parts.items()}
            out[name] = {**medians, "attended_tokens": self.attended[name], "samples": parts}
        return out


def run_backend(paths: dict[str, Path], backend: str, args) -> list[dict]:
    """Every context with both models on one attention backend. All contexts are built first and
    each repeat steps through all of them, so that a slow phase of the machine falls on all."""
    from tqdm import tqdm

    engines = {
        name: Engine(
            model_path=str(path),
            attention_backend=backend,
            num_threads=args.threads,
            max_running_requests=args.batch * len(args.contexts),
            max_total_tokens=args.batch * sum(c + PAGE for c in args.contexts),
            page_size=PAGE,
            context_length=max(args.contexts) + PAGE,
            disable_radix_cache=True,
            overlap_schedule="off",
        )
        for name, path in paths.items()
    }
    gen = torch.Generator().manual_seed(args.seed)
    try:
        timers = {name: PartTimer(engines[name].model) for name in MODELS}
        contexts = [Context(engines, c, args.batch, gen) for c in args.contexts]
        checked = [c.check(timers) for c in contexts]
        for _ in tqdm(range(args.repeats), desc=f"backend {backend}", unit="repeat", file=sys.stderr):
            for c in contexts:
                c.time(timers)
        return [c.result(done) for c, done in zip(contexts, checked)]
    finally:
        for engine in engines.values():
            engine.close()


def report(results: dict[str, list[dict]]) -> str:
    lines = []
    for backend, points in results.items():
        lines.append(f"attention backend {backend}, median ms per decode step:")
        head = ("context", "dense step", "sparse step", "indexer", "sparse MLA", "dense MLA", "attended s/d")
        lines.append(f"{head[0]:>8} {head[1]:>11} {head[2]:>11} {head[3]:>9} {head[4]:>10} {head[5]:>9} {head[6]:>14}")
        for p in points:
            d, s = p["dense"], p["sparse"]
            seen = f"{s['attended_tokens']['max']}/{d['attended_tokens']['max']}"
            lines.append(
                f"{p['context']:>8} {d['step_ms']:>11.2f} {s['step_ms']:>11.2f} {s['indexer_ms']:>9.2f} "
                f"{s['mla_ms']:>10.2f} {d['mla_ms']:>9.2f} {seen:>14}"
            )
    return "\n".join(lines)


def draw(results: dict[str, list[dict]], topk: int, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    curves = (
        ("dense", "step_ms", "dense step", "tab:blue", "-"),
        ("sparse", "step_ms", "sparse step", "tab:orange", "-"),
        ("dense", "mla_ms", "dense MLA", "tab:blue", "--"),
        ("sparse", "mla_ms", "sparse MLA", "tab:orange", "--"),
        ("sparse", "indexer_ms", "sparse indexer", "tab:green", ":"),
    )
    for ax, (backend, points) in zip(axes[0], results.items()):
        x = [p["context"] for p in points]
        for model, key, label, color, style in curves:
            ax.plot(x, [p[model][key] for p in points], marker="o", color=color, linestyle=style, label=label)
        ax.axvline(topk, color="grey", linestyle="--", linewidth=0.8, label=f"index_topk {topk}")
        ax.set_xticks(x, [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in x])
        ax.set_xlabel("context (cached tokens)")
        ax.set_ylabel("ms per decode step (median)")
        ax.set_title(f"attention backend {backend}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", help=f"cached tokens per sequence (default {CONTEXTS})")
    p.add_argument("--batch", type=int, default=4, help="sequences decoding together")
    p.add_argument("--repeats", type=int, default=21, help="timed rounds: one step per context and model each")
    p.add_argument("--backends", nargs="+", default=["cpu", "torch"], help="attention backends, each in turn")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadiest where other work shares the cores)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the cached rows and the new tokens")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG of step time and its attention parts against context")
    p.add_argument("--quick", action="store_true", help=f"the tiny preset, index_topk 32, contexts {QUICK_CONTEXTS}")
    args = p.parse_args(argv)
    args.contexts = args.contexts or list(QUICK_CONTEXTS if args.quick else CONTEXTS)
    if args.quick:
        args.batch, args.repeats = 2, 1
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_models(Path(tmp), args.quick)
        config = json.loads((paths["sparse"] / "config.json").read_text())
        results = {backend: run_backend(paths, backend, args) for backend in args.backends}
    print(report(results))
    topk = config["index_topk"]
    if args.json:
        shapes = {k: config[k] for k in (*SHAPES, "max_position_embeddings")}
        write_json(
            args.json,
            {
                "model": shapes,
                "batch": args.batch,
                "repeats": args.repeats,
                "threads": args.threads,
                "torch": torch.__version__,
                "backends": results,
            },
        )
    if args.plot:
        draw(results, topk, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
