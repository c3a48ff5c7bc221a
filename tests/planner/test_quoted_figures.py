"""The planner's figures that docs/planner.md ("DeepSeek-V3.2 on 64 H800") and
docs/supported-models.md quote in tables are what the planner computes today: each table row is
parsed from the page and recomputed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd_engine.cli import main
from afd_engine.planner.footprint import footprint
from afd_engine.planner.hardware import HARDWARE
from afd_engine.planner.model_spec import MODELS, get_model
from afd_engine.planner.search import SearchSpace, search
from afd_engine.planner.stages import StageModel

DOCS = Path(__file__).resolve().parents[2] / "docs"
H800 = HARDWARE["H800"]
SHORT = {"V3": "deepseek-v3", "V3.2": "deepseek-v3.2"}
PAGE_NAMES = {  # the names the supported-models table shows
    "DeepSeek-V3": "deepseek-v3",
    "Kimi-K2": "kimi-k2",
    "DeepSeek-V3.2": "deepseek-v3.2",
    "GLM-4.6": "glm-4.6",
    "MiniMax-M2": "minimax-m2",
    "Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Qwen3-30B-A3B": str(Path(__file__).resolve().parents[1] / "models" / "real_configs" / "qwen3-30B-A3B.json"),
}


def rows(page: str, first: tuple[str, ...]) -> list[list[str]]:
    """Cells of the table rows of docs/`page` whose first cell is one of `first`."""
    out = []
    for line in (DOCS / page).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in first:
            out.append(cells)
    return out


LAYOUT_ROWS = rows("planner.md", ("bf16", "fp8"))


def test_layout_table_has_every_row():
    assert len(LAYOUT_ROWS) == 12


@pytest.mark.parametrize("row", LAYOUT_ROWS, ids=lambda r: "-".join(r[:3]))
def test_best_layouts_on_64_h800(row):
    kv, ctx, model, layout, seqs, tpot, tps, bound, colocated = row
    sm = StageModel(MODELS[SHORT[model]], H800, H800, int(ctx.rstrip("K")) * 1024, kv)
    best = search(sm, "afd", 50, SearchSpace(total_gpus=64))[0]
    d = best.deployment
    shared = "FFN" if d.shared_expert == "ffn" else "attention"
    assert layout == f"{d.attn_gpus}+{d.ffn_gpus}, {d.micro_batches}, {shared}"
    shown = (int(seqs), float(tpot), int(tps.replace(",", "")), bound)
    assert shown == (d.seqs_per_gpu, round(best.tpot_ms, 1), round(best.tokens_per_gpu_s), best.bound)
    col = search(sm, "colocated", 50, SearchSpace(total_gpus=64))[0]
    assert colocated == f"{round(col.tokens_per_gpu_s):,} ({col.tpot_ms:.1f})"


def test_attention_core_per_token():
    (head, v3, v32, kv) = rows("planner.md", ("context", "DeepSeek-V3, us per token and layer")) + rows(
        "planner.md", ("DeepSeek-V3.2, us per token and layer", "DeepSeek-V3 / V3.2 KV per sequence, GB")
    )
    contexts = [int(c.replace(",", "")) for c in head[1:]]
    figures = {name: footprint(MODELS[name], H800, 16, "bf16", contexts=tuple(contexts)) for name in SHORT.values()}
    for cells, name in ((v3, "deepseek-v3"), (v32, "deepseek-v3.2")):
        assert cells[1:] == [f"{figures[name]['attention_core_us'][c]:.2f}" for c in contexts]
    gb = [figures[n]["kv_gb_per_seq"] for n in SHORT.values()]
    assert kv[1:] == [f"{gb[0][c]:.2f} / {gb[1][c]:.2f}" for c in contexts]


@pytest.mark.parametrize("row", rows("planner.md", ("DeepSeek-V3", "DeepSeek-V3.2")), ids=lambda r: r[0])
def test_long_prompts_simulated(row, capsys):
    args = ["--poisson", "2", "--duration", "60", "--lengths", "fixed:30000,300", "--ttft-slo", "15000"]
    spec = "pd:prefill=[colocated:gpus=32],decode=[afd:a=16,f=16,mb=2]"
    model = "deepseek-v3.2" if row[0].endswith("V3.2") else "deepseek-v3"
    argv = ["plan", "simulate", "--model", model, *args, "--tpot-slo", "50", "--deployment", spec, "--json", "-"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)["deployments"][0]
    ttft, tpot = d["ttft_s"], d["tpot_s"]
    shown = [
        f"{ttft['p50']:.1f} / {ttft['p90']:.1f}",
        f"{tpot['p50'] * 1e3:.1f} / {tpot['p90'] * 1e3:.1f}",
        f"{100 * d['attainment']:.1f}%",
    ]
    assert row[1:] == shown


MEMORY_ROWS = rows("supported-models.md", tuple(PAGE_NAMES))


def test_memory_table_has_every_row():
    assert [r[0] for r in MEMORY_ROWS] == list(PAGE_NAMES)


@pytest.mark.parametrize("row", MEMORY_ROWS, ids=lambda r: r[0])
def test_memory_per_role(row):
    m = get_model(PAGE_NAMES[row[0]])
    f = footprint(m, H800, 16, "bf16")
    shown = [
        f["attention"],
        f"{f['total_params_b']:.1f} / {f['activated_params_b']:.1f}",
        f"{f['kv_bytes_per_token']:,}",
        f"{f['attn_weights_gb']:.1f}",
        f"{f['ffn_weights_gb']:.1f}",
        str(f["min_ffn_gpus"]),
        f"{f['kv_tokens_per_attn_gpu']:,}",
    ]
    assert row[1:] == shown
