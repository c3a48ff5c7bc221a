"""Architectures near the served ones that the engine does not run: each is refused in one line that
names it and what the engine lacks for it, from the config alone (in the API and through
`afd serve`). tests/models/test_config_reading.py covers Qwen3-Next by architecture and Qwen3.5-MoE
by model_type on a full checkpoint."""

from __future__ import annotations

import json

import pytest

from afd_engine.errors import ModelLoadError
from afd_engine.hf_config import SUPPORTED_ARCHITECTURES
from afd_engine.model_config import ModelConfig
from tests.process_helpers import afd_run, free_port

V4 = "DeepSeek-V4's compressed sparse attention and hyper-connections"
QWEN3_NEXT = "Qwen3-Next's hybrid attention (Gated DeltaNet linear-attention layers among full-attention ones)"
GPT_OSS = "gpt-oss's attention sinks, sliding-window layers and MXFP4 experts"

# (config.json's architectures and model_type, the name the message gives, what is missing)
REFUSED = {
    "deepseek-v4": (
        {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"},
        "DeepseekV4ForCausalLM",
        V4,
    ),
    "deepseek-v4-by-type": ({"model_type": "deepseek_v4"}, "deepseek_v4", V4),
    "qwen3-next-by-type": ({"model_type": "qwen3_next"}, "qwen3_next", QWEN3_NEXT),
    "qwen3.5-moe": (
        {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe"},
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3.5-MoE's hybrid linear attention and vision tower",
    ),
    "qwen3.5-moe-text": (
        {"model_type": "qwen3_5_moe_text"},
        "qwen3_5_moe_text",
        "Qwen3.5-MoE's hybrid linear attention",
    ),
    "qwen3.5": (
        {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"},
        "Qwen3_5ForConditionalGeneration",
        "Qwen3.5's hybrid linear attention and vision tower",
    ),
    "gpt-oss": ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"}, "GptOssForCausalLM", GPT_OSS),
    "gpt-oss-by-type": ({"model_type": "gpt_oss"}, "gpt_oss", GPT_OSS),
}


def refusal(name: str, missing: str) -> str:
    return (
        f"{name} is not supported: the engine does not implement {missing}; "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


@pytest.mark.parametrize("case", REFUSED)
def test_the_config_is_refused_with_one_line_naming_what_is_missing(case):
    raw, name, missing = REFUSED[case]
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dict(raw)
    assert str(err.value) == refusal(name, missing)


@pytest.mark.parametrize("case", ["deepseek-v4", "qwen3-next-by-type", "gpt-oss"])
def test_serve_prints_the_refusal_and_exits_2(case, tmp_path):
    """A directory with only config.json: nothing else is read before the refusal."""
    raw, name, missing = REFUSED[case]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    res = afd_run("serve", "--model-path", str(tmp_path), "--port", str(free_port()), "--num-threads", "1", timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == ["afd serve: error: " + refusal(name, missing)]
