"""The planner on DeepSeek-V3.2 (sparse attention), Kimi-K2, GLM-4.5/4.6 and MiniMax-M2: shapes from
the published configs, parameter counts against the model cards, KV bytes against the engine's
pool, the indexer's cost in the stage model, and the simulator's attended positions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from afd_engine.cli import main
from afd_engine.errors import ConfigError
from afd_engine.planner.deploy import Deployment, estimate
from afd_engine.planner.hardware import HARDWARE
from afd_engine.planner.model_spec import MODELS, get_model, model_from_hf_config
from afd_engine.planner.sim.rank import Rank, attended_pairs
from afd_engine.planner.sim.request import DECODE
from afd_engine.planner.simulate import SLO, ClusterConfig, InstanceConfig, KVLink, LinearStepTime, StageStepTime
from afd_engine.planner.simulate import simulate as run_simulation
from afd_engine.planner.stages import StageModel
from afd_engine.planner.traces import load_mooncake, poisson

REPO = Path(__file__).resolve().parents[2]
REAL = REPO / "tests" / "models" / "real_configs"
MOONCAKE = REPO / "benchmarks" / "datasets" / "mooncake_conversation_first30min.jsonl"
H800 = HARDWARE["H800"]

# catalog name -> the published config.json it is the shape of
PUBLISHED = {
    "deepseek-v3.2": "deepseek_v3.2",
    "kimi-k2": "kimi-k2-instruct",
    "glm-4.6": "glm-4.6",
    "minimax-m2": "minimax-m2",
}
# The model cards' figures (billions): total, activated. The cards round (GLM-4.6's 355B counts
# 352.8B of served weights, Kimi-K2's 1.04T 1.026T) and count activated parameters without the
# input embedding table (a lookup, not a matmul).
CARDS = {"deepseek-v3.2": (671, 37), "kimi-k2": (1040, 32), "glm-4.6": (355, 32), "minimax-m2": (230, 10)}


def published(name: str) -> dict:
    return json.loads((REAL / f"{PUBLISHED[name]}.json").read_text())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_catalog_is_the_published_config(name):
    parsed = model_from_hf_config(published(name), "published")
    assert dataclasses.replace(parsed, name=name) == MODELS[name]
    assert get_model(str(REAL / f"{PUBLISHED[name]}.json")).total_params() == MODELS[name].total_params()


@pytest.mark.parametrize("name", sorted(CARDS))
def test_parameter_counts_match_the_model_cards(name):
    m = MODELS[name]
    total_b, active_b = CARDS[name]
    assert m.total_params() / 1e9 == pytest.approx(total_b, rel=0.02)
    assert (m.activated_params() - m.vocab * m.hidden) / 1e9 == pytest.approx(active_b, rel=0.05)


def test_shapes_of_the_new_families():
    v3, v32, kimi = MODELS["deepseek-v3"], MODELS["deepseek-v3.2"], MODELS["kimi-k2"]
    glm, mm = MODELS["glm-4.6"], MODELS["minimax-m2"]
    # V3.2 is V3 plus the indexer's wq_b (q-LoRA -> 64 x 128), wk (hidden -> 128) and weights_proj
    # (hidden -> 64) in each of its 61 layers
    indexer = 1536 * 64 * 128 + 7168 * 128 + 7168 * 64
    assert v32.total_params() - v3.total_params() == 61 * indexer
    assert (v32.attention.index_topk, v32.attention.attended(1000), v32.attention.attended(10**5)) == (2048, 1000, 2048)
    assert (kimi.experts, kimi.attention.heads, kimi.dense_layers, kimi.moe_layers) == (384, 64, 1, 60)
    assert (glm.attention.kind, glm.attention.heads, glm.attention.kv_heads, glm.dense_layers) == ("gqa", 96, 8, 3)
    assert (glm.shared_experts, glm.shared_width, glm.experts) == (1, 1536, 160)
    assert (mm.dense_layers, mm.shared_experts, mm.expert_width, mm.experts) == (0, 0, 1536, 256)


def test_config_errors_name_the_problem():
    v32 = {k: v for k, v in published("deepseek-v3.2").items() if k != "index_topk"}
    with pytest.raises(ConfigError, match="model v32: config.json lacks 'index_topk'"):
        model_from_hf_config(v32, "v32")
    lightning = {**published("minimax-m2"), "attn_type_list": [0] + [1] * 61}
    with pytest.raises(ConfigError, match=r"lightning \(linear\) attention layers \(attn_type_list 0\) are not"):
        model_from_hf_config(lightning, "m2")
    # the routed experts under transformers 5.x's name are read as well
    m2 = {k: v for k, v in published("minimax-m2").items() if k != "num_local_experts"} | {"num_experts": 256}
    assert dataclasses.replace(model_from_hf_config(m2, "minimax-m2"), name="minimax-m2") == MODELS["minimax-m2"]
    with pytest.raises(
        ConfigError, match="model_type 'deepseek_v4' is not supported by the planner .*kimi_k2, glm4_moe"
    ):
        model_from_hf_config({"model_type": "deepseek_v4"}, "v4")


def test_kv_bytes_per_token():
    v32 = MODELS["deepseek-v3.2"]
    # MLA's latent and rope key at 2 bytes, the index key as e4m3 bytes and an fp32 scale, or bf16
    assert v32.kv_bytes_per_token(2) == v32.kv_bytes_per_token(2, "fp8") == 61 * (576 * 2 + 128 + 4)
    assert v32.kv_bytes_per_token(2, "bf16") == 61 * (576 + 128) * 2
    assert MODELS["deepseek-v3"].kv_bytes_per_token(2, "bf16") == 61 * 576 * 2  # no indexer, no key
    assert MODELS["glm-4.6"].kv_bytes_per_token(2) == 92 * 2 * 8 * 128 * 2
    assert MODELS["minimax-m2"].kv_bytes_per_token(1) == 62 * 2 * 8 * 128


@pytest.mark.parametrize("config", ["v32-sparse", "glm45"])
def test_counts_and_kv_equal_a_real_checkpoint(config, tiny_model_factory):
    """Every matrix of a real (tiny) V3.2 or GLM-4.5 checkpoint is counted once, and the KV bytes per
    token are what the engine's pool allocates, the index key in bf16 and as fp8 bytes and a scale."""
    from afd_engine.model_config import ModelConfig
    from afd_engine.runtime.kv_cache import KVPool

    path = Path(tiny_model_factory(config))
    cfg, model = ModelConfig.from_pretrained(path), get_model(str(path))
    with safe_open(str(path / "model.safetensors"), "pt") as st:
        shapes = [st.get_slice(n).get_shape() for n in st.keys()]
    assert model.total_params() == sum(s[0] * s[1] for s in shapes if len(s) == 2)

    def pool_bytes(c: ModelConfig, dtype: torch.dtype) -> int:
        return KVPool.bytes_per_page(c.num_layers, c.kv_cache_dim, 1, dtype)

    assert model.kv_bytes_per_token(2, "bf16") == pool_bytes(cfg, torch.bfloat16)
    assert model.kv_bytes_per_token(4) == pool_bytes(cfg, torch.float32) or config == "v32-sparse"
    if config == "v32-sparse":
        for dtype in (torch.bfloat16, torch.float32):
            size = dtype.itemsize
            assert model.kv_bytes_per_token(size, "fp8") == pool_bytes(cfg.with_index_cache("fp8", size), dtype)


def test_sparse_attention_core_is_the_indexer_plus_mla_over_top_k():
    v3 = StageModel(MODELS["deepseek-v3"], H800, H800, 4096, "bf16")
    sm = StageModel(MODELS["deepseek-v3.2"], H800, H800, 4096, "bf16")
    compute, memory = 989e12 * 0.45, 3.35e12 * 0.7  # H800's attention efficiency factors
    # per attended position: absorbed MLA, 2 x 128 heads x (2 x 512 + 64) FLOPs or 576 bf16 values
    mla = max(2 * 128 * (2 * 512 + 64) / compute, 576 * 2 / memory) * 1e6
    # per indexed position: 64 heads x 128 fp8 multiply-adds, or the 128 + 4 bytes of its key
    indexer = max(2 * 64 * 128 / (1979e12 * 0.45), 132 / memory) * 1e6
    assert sm.attended_position_us() == pytest.approx(mla, rel=1e-12) == v3.attended_position_us()
    assert sm.indexed_position_us() == pytest.approx(indexer, rel=1e-12) and v3.indexed_position_us() == 0
    bf16 = dataclasses.replace(sm, index_dtype="bf16")
    assert bf16.indexed_position_us() == pytest.approx(256 / memory * 1e6, rel=1e-12)
    for ctx in (1000, 2048, 8192, 65536):
        at = dataclasses.replace(sm, context=ctx)
        assert at.attention_core_us(3) == pytest.approx(3 * (ctx * indexer + min(ctx, 2048) * mla), rel=1e-12)
        assert dataclasses.replace(v3, context=ctx).attention_core_us(3) == pytest.approx(3 * ctx * mla, rel=1e-12)
    # past index_topk only the indexer grows: a ninth of V3's growth per position, or less
    grow = dataclasses.replace(sm, context=65536).attention_core_us(1) - sm.attention_core_us(1)
    assert grow == pytest.approx((65536 - 4096) * indexer, rel=1e-9) and grow < (65536 - 4096) * mla / 9
    # the indexer's math in its own precision: fp8 peak (bf16 with bf16 keys) where compute bounds it
    fast = dataclasses.replace(sm, attn_hw=dataclasses.replace(H800, mem_bw_tbs=1000.0))
    for dtype, peak in (("fp8", 1979e12), ("bf16", 989e12)):
        flops = 2 * 64 * 128 / (peak * 0.45) * 1e6
        assert dataclasses.replace(fast, index_dtype=dtype).indexed_position_us() == pytest.approx(flops, rel=1e-12)
        assert dataclasses.replace(sm, index_dtype=dtype).prefill_pair_us()[0] == pytest.approx(flops, rel=1e-12)
    # the KV cache of a sequence holds the index key too
    assert sm.kv_bytes_per_seq() == 4096 * 61 * (576 * 2 + 132)
    with pytest.raises(ConfigError, match="--index-cache-dtype 'fp4' must be one of fp8, bf16"):
        StageModel(MODELS["deepseek-v3.2"], H800, H800, 4096, index_dtype="fp4")


def test_uniform_sparse_decode_step_equals_the_planners_tpot():
    ctx, seqs = 30000, 64
    sm = StageModel(MODELS["deepseek-v3.2"], H800, H800, ctx, "bf16")
    est = estimate(sm, Deployment("afd", 48, 16, 2, seqs))
    step = StageStepTime(sm, "afd", 48, 16, 2, max_tokens=256)
    seconds, _ = step.step([(seqs, seqs, seqs * ctx, 0.0, seqs * 2048, 0.0)] * 48)
    assert seconds * 1e3 == pytest.approx(est.tpot_ms, rel=1e-9)
    # a load that attends to everything it reads costs what V3's attention would, plus the indexer
    dense = step.step([(seqs, seqs, seqs * ctx, 0.0)] * 48)[0]
    assert dense > seconds


def test_sparse_prefill_chunk_pays_the_indexer_over_the_prefix():
    sm = StageModel(MODELS["deepseek-v3.2"], H800, H800, 4096, "bf16")
    step = StageStepTime(sm, "colocated", 16, 0, 1, max_tokens=2048)
    n, prefix = 2048, 30000
    short = step.step([(n, 1, 0.0, n * (n + 1) / 2, 0.0, attended_pairs(0, n, 2048))])[0]
    long = step.step([(n, 1, 0.0, n * prefix + n * (n + 1) / 2, 0.0, attended_pairs(prefix, n, 2048))])[0]
    # the indexer scores every extra pair (fp8); MLA, absorbed, only up to 2048 keys per query
    extra_index = n * prefix * 2 * 64 * 128 / (1979e12 * 0.45)
    extra_mla = (n * 2048 - n * (n + 1) / 2) * 2 * 128 * (2 * 512 + 64) / (989e12 * 0.45)
    assert long - short == pytest.approx(61 * (extra_index + extra_mla), rel=1e-6)


def test_attended_pairs():
    def brute(start, n, k):
        return sum(min(p, k) for p in range(start + 1, start + n + 1))

    for start, n, k in [(0, 10, 4), (3, 10, 4), (4, 10, 4), (9, 3, 4), (0, 3, 10), (7, 5, 10), (100, 1, 8)]:
        assert attended_pairs(start, n, k) == brute(start, n, k)


def _checked_schedule(checks: list):
    """Rank.schedule, each sparse load checked against its decoders and chunks counted one by one."""
    plain = Rank.schedule

    def schedule(self, s):
        load = plain(self, s)
        if load is None or not self.K:
            return load
        lengths = [r.t0 + s - r.s0 + 1 for r in self.running.values() if r.state == DECODE]
        chunks = sum(sum(min(p, self.K) for p in range(r.kv + 1, r.kv + n + 1)) for r, n in self.chunks)
        assert (load[2], load[4], load[5]) == (sum(lengths), sum(min(x, self.K) for x in lengths), chunks)
        checks.append((sum(x < self.K for x in lengths), sum(x >= self.K for x in lengths)))
        return load

    return schedule


@pytest.mark.parametrize("layout", ["colocated", "pd"])
@pytest.mark.parametrize("workload", ["sharegpt", "mooncake"])
def test_simulated_ranks_track_the_positions_attention_attends_to(layout, workload, monkeypatch):
    """Decoders cross top-k, are preempted (a small pool), finish, join after a prefix-cache hit
    (Mooncake's shared prefixes) or (PD) a KV transfer: every step's attended positions and pairs
    equal a count from scratch."""
    checks: list[tuple[int, int]] = []
    monkeypatch.setattr(Rank, "schedule", _checked_schedule(checks))
    if workload == "sharegpt":  # outputs of hundreds of tokens: decoders cross k = 256 as they go
        trace, k = poisson(20, 20, seed=1, lengths="sharegpt"), 256
    else:
        trace, k = load_mooncake(str(MOONCAKE), rate_scale=8.0, length_scale=1 / 8, limit=300), 1800
    base = dict(step_time=LinearStepTime(0.01, 1e-4), page_tokens=16, max_batch_tokens=512, attention_topk=k)
    small = InstanceConfig(ranks=2, kv_pages=300, max_running=64, **base)
    if layout == "colocated":
        cluster = ClusterConfig("sparse", small)
    else:
        prefill = InstanceConfig(ranks=1, kv_pages=2000, max_running=64, **base)
        cluster = ClusterConfig("sparse-pd", prefill, small, KVLink(1000.0, 1e9, 1e-5))
    summary = run_simulation(trace, cluster, SLO(10.0, 1.0)).summary
    assert summary["preemptions"] > 0 and summary["completed"] > 0.8 * summary["requests"]
    assert summary["prefix_hit_rate"] > 0 or workload == "sharegpt"
    # many steps, some with decoders on both sides of k at once
    assert len(checks) > 500 and sum(below > 0 and above > 0 for below, above in checks) > 100


def test_published_configs_flow_through_the_cli(capsys):
    assert main(["plan", "model", "--model", "deepseek-v3.2", "glm-4.6", "--contexts", "8192", "65536", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["models"]
    assert [r["kv_bytes_per_token"] for r in rows] == [61 * (576 * 2 + 132), 92 * 4096]
    core = rows[0]["attention_core_us"]
    assert core["65536"] < 3 * core["8192"] and rows[1]["attention_core_us"]["65536"] == pytest.approx(
        8 * rows[1]["attention_core_us"]["8192"]
    )
    for name in PUBLISHED:
        args = ["--model", str(REAL / f"{PUBLISHED[name]}.json"), "--mode", "afd", "--attn-gpus", "48"]
        assert main(["plan", "deploy", *args, "--ffn-gpus", "16", "--context", "32768", "--top", "1", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["fits"] and out["deployment"]["attn_gpus"] == 48
        assert out["index_cache_dtype"] == ("fp8" if name == "deepseek-v3.2" else None)
    assert main(["plan", "model", "--model", "deepseek-v3.2", "--index-cache-dtype", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["models"][0]["kv_bytes_per_token"] == 61 * (576 + 128) * 2
    # bf16 index keys: more KV bytes per sequence, so fewer sequences fit the same attention GPUs
    seqs = {}
    for dtype in ("fp8", "bf16"):
        argv = ["plan", "deploy", "--model", "deepseek-v3.2", "--mode", "afd", "--attn-gpus", "48", "--ffn-gpus", "16"]
        assert main([*argv, "--context", "65536", "--index-cache-dtype", dtype, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["index_cache_dtype"] == dtype
        seqs[dtype] = out["deployment"]["seqs_per_gpu"]
    assert seqs["bf16"] < seqs["fp8"]
    # the human tables
    assert main(["plan", "model", "--model", "deepseek-v3.2", "minimax-m2", "--contexts", "8192"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:4] == ["deepseek-v3.2", "MLA,", "top-2048", "indexer"] and "78,324" in lines[1]
    assert lines[2].split()[:3] == ["minimax-m2", "GQA", "48/8"] and "253,952" in lines[2]
    assert lines[4].startswith("decode attention core") and lines[6].startswith("deepseek-v3.2")
    assert main(["plan", "deploy", "--model", "deepseek-v3.2", "--mode", "afd", "--gpus", "64", "--top", "1"]) == 0
    assert "deepseek-v3.2, context 4096, attention/KV bf16, indexer keys fp8" in capsys.readouterr().out


def test_simulate_takes_the_new_families(capsys):
    """The simulator's KV pool and PD link carry V3.2's index key; its steps charge the indexer over
    the whole context and MLA over the top 2048 only, in prefill and in decode."""
    spec = "pd:prefill=[colocated:gpus=32],decode=[afd:a=8,f=16,mb=2]"
    rows = {}
    for model in ("deepseek-v3", "deepseek-v3.2", "glm-4.6", "minimax-m2", "kimi-k2"):
        argv = ["plan", "simulate", "--model", model, "--poisson", "4", "--duration", "20"]
        assert main([*argv, "--lengths", "fixed:30000,300", "--deployment", spec, "--json", "-"]) == 0
        rows[model] = json.loads(capsys.readouterr().out)["deployments"][0]
    v3, v32 = rows["deepseek-v3"], rows["deepseek-v3.2"]
    # the index key takes room in the pool: fewer tokens fit than in V3's
    assert v32["layout"]["decode"]["kv_tokens_per_rank"] < v3["layout"]["decode"]["kv_tokens_per_rank"]
    # 30K-token prompts and contexts: V3.2's attention covers 2048 of them where V3's covers all
    assert v32["ttft_s"]["p50"] < 0.7 * v3["ttft_s"]["p50"] and v32["tpot_s"]["p50"] < v3["tpot_s"]["p50"]
    assert all(r["completed"] == v3["completed"] > 0 for r in rows.values())
    # bf16 index keys take more of the pool than fp8 bytes and a scale
    argv = ["plan", "simulate", "--model", "deepseek-v3.2", "--poisson", "1", "--duration", "2"]
    assert main([*argv, "--deployment", spec, "--index-cache-dtype", "bf16", "--json", "-"]) == 0
    bf16 = json.loads(capsys.readouterr().out)["deployments"][0]["layout"]["decode"]["kv_tokens_per_rank"]
    assert bf16 < v32["layout"]["decode"]["kv_tokens_per_rank"]
