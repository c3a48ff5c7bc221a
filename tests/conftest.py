"""Shared fixtures: tiny checkpoints in the real Hugging Face format, made once per session."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from afd_engine.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]

# Tests run two workers on two cores; one torch thread each keeps them from fighting.
torch.set_num_threads(int(os.environ.get("AFD_TEST_THREADS", "1")))
# Without a GPU the Triton kernels run under Triton's interpreter; it must be chosen before the
# first kernel module is imported, and engine subprocesses inherit it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The slow tier: `make test` runs it, `make test-fast` (-m "not slow") leaves it out. Whole files
# whose tests start deployments of rank processes or servers, run benchmarks, or run whole engines
# under the Triton interpreter; a single test of that kind elsewhere carries @pytest.mark.slow.
# (Patterns are glob patterns relative to the repository root.)
SLOW_FILES = (
    "tests/benchmarks/test_bench_*.py",
    "tests/benchmarks/test_gpu_check.py",
    "tests/benchmarks/test_lib_server.py",
    "tests/benchmarks/test_tune_kernels.py",
    "tests/comm/test_dispatch_processes.py",
    "tests/comm/test_transports.py",
    "tests/disagg/test_pd_deployments.py",
    "tests/disagg/test_pd_failover.py",
    "tests/disagg/test_pd_serve.py",
    "tests/deploy/test_grafana.py",
    "tests/distributed/test_attention_failover.py",
    "tests/distributed/test_cluster_secret.py",
    "tests/distributed/test_deployments.py",
    "tests/distributed/test_elastic_experts.py",
    "tests/distributed/test_eplb_deployments.py",
    "tests/distributed/test_ffn_fault_tolerance.py",
    "tests/distributed/test_hung_rank.py",
    "tests/distributed/test_launch_roles.py",
    "tests/distributed/test_prefix_cache_deployments.py",
    "tests/distributed/test_serve_deployments.py",
    "tests/distributed/test_torch_transport.py",
    "tests/docs/test_examples.py",
    "tests/kernels/test_triton_engine.py",
    "tests/server/test_api.py",
    "tests/server/test_auth.py",
    "tests/server/test_drain.py",
    "tests/server/test_engine_death.py",
    "tests/server/test_expert_load_api.py",
    "tests/server/test_fuzz.py",
    "tests/server/test_hardening.py",
    "tests/server/test_prompt_logprobs_api.py",
    "tests/server/test_qwen3_api.py",
    "tests/server/test_schema.py",
    "tests/server/test_structured_api.py",
    "tests/test_cli.py",
)


def pytest_collection_modifyitems(config, items):
    for pattern in SLOW_FILES:
        if not list(ROOT.glob(pattern)):
            raise pytest.UsageError(f"tests/conftest.py SLOW_FILES: {pattern} matches no file")
    for item in items:
        rel = Path(item.path).resolve().relative_to(ROOT)
        if any(rel.match(pattern) for pattern in SLOW_FILES):
            item.add_marker(pytest.mark.slow)


# name -> (arch, overrides): the configurations every parity test runs against.
TINY_CONFIGS = {
    "v3-yarn-qlora": ("deepseek_v3", {}),
    "v3-dense0": ("deepseek_v3", {"first_k_dense_replace": 0}),
    "v3-dense2-rope-params": (
        "deepseek_v3",
        {
            "first_k_dense_replace": 2,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 2.0,
                "original_max_position_embeddings": 256,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
            },
        },
    ),
    "v2-lite": ("deepseek_v2", {}),
    # Qwen3-MoE: GQA ratio 4 with dense layer 0; ratio 1 with every other layer sparse and plain
    # top-k weights; ratio 2 with tied embeddings and a dense layer among sparse ones
    "qwen3-gqa4": ("qwen3_moe", {}),
    "qwen3-mha-sparse2": (
        "qwen3_moe",
        {"num_key_value_heads": 8, "decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": False},
    ),
    "qwen3-tied": ("qwen3_moe", {"num_key_value_heads": 4, "mlp_only_layers": [2], "tie_word_embeddings": True}),
    # DeepSeek-V3.2: the indexer keeps 8 tokens per query, fewer than most prompts here
    "v32-sparse": ("deepseek_v32", {}),
    # GLM-4.5: GQA with q/k/v biases, q/k norm, rope over half of each head, grouped sigmoid routing
    "glm45": ("glm4_moe", {}),
    # MiniMax-M2: GQA with q/k norm over whole projections, rope over half of each head, no shared expert
    "minimax-m2": ("minimax_m2", {}),
    "v2-group-limited": (
        "deepseek_v2",
        {
            "q_lora_rank": 48,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 0,
        },
    ),
}


# name -> a TINY_CONFIGS checkpoint loaded and saved again by the installed transformers, which
# writes today's spellings (5.x: rope_parameters, Qwen3-MoE's num_local_experts)
RESAVED_CONFIGS = {
    "v3-resaved": "v3-yarn-qlora",
    "v2-resaved": "v2-lite",
    "qwen3-resaved": "qwen3-gqa4",
    "v32-resaved": "v32-sparse",
    "glm45-resaved": "glm45",
    "minimax-resaved": "minimax-m2",
}


def resave_with_transformers(src: str, dst: Path) -> str:
    """`src` through transformers' from_pretrained and save_pretrained, tokenizer files copied."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("config.json", "*.safetensors*"), dirs_exist_ok=True)
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(dst)
    return str(dst)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    made: dict[tuple, str] = {}

    def make(name: str, **kwargs) -> str:
        key = (name, tuple(sorted(kwargs.items())))
        if key in made:
            return made[key]
        if name in RESAVED_CONFIGS:
            made[key] = resave_with_transformers(make(RESAVED_CONFIGS[name], **kwargs), tmp_path_factory.mktemp(name))
        else:
            arch, overrides = TINY_CONFIGS[name]
            out = tmp_path_factory.mktemp(name)
            made[key] = str(make_tiny_model(out, arch=arch, seed=kwargs.pop("seed", 0), overrides=overrides, **kwargs))
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_v3(tiny_model_factory) -> str:
    return tiny_model_factory("v3-yarn-qlora")
