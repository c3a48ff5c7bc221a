"""A broken checkpoint directory is named before any weight is read or any port is bound: which file,
which tensor, one line, exit code 2 from `afd serve`."""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from afd_engine.errors import ModelLoadError
from afd_engine.models.checkpoint import INDEX, inspect_checkpoint
from afd_engine.tiny_model import make_tiny_model
from tests.process_helpers import afd_run, free_port

KV_B = "model.layers.2.self_attn.kv_b_proj.weight"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sharded"), shards=3)


def shard_of(ckpt: Path, name: str) -> Path:
    return ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][name]


def rewrite_shard(ckpt: Path, name: str, change) -> Path:
    """The shard holding `name` written again with `change(tensors)` applied."""
    file = shard_of(ckpt, name)
    with safe_open(str(file), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    change(tensors)
    save_file(tensors, str(file))
    return file


def no_config(ckpt: Path) -> str:
    (ckpt / "config.json").unlink()
    return f"'{ckpt}' has no config.json; is it a Hugging Face checkpoint directory?"


def config_not_json(ckpt: Path) -> str:
    (ckpt / "config.json").write_text("{'architectures': oops")
    return f"{ckpt / 'config.json'} is not valid JSON: "


def index_not_json(ckpt: Path) -> str:
    (ckpt / INDEX).write_text("[1, 2")
    return f"{ckpt / INDEX} is not a safetensors index (JSON with a weight_map): "


def shard_missing(ckpt: Path) -> str:
    file = shard_of(ckpt, KV_B)
    file.unlink()
    return f"{file} is missing: {INDEX} places tensors there (e.g. "


def wrong_dtype(ckpt: Path) -> str:
    file = rewrite_shard(ckpt, KV_B, lambda t: t.update({KV_B: t[KV_B].long()}))
    return f"{file}: tensor {KV_B} is I64; weights must be F32, BF16, F16"


def wrong_shape(ckpt: Path) -> str:
    file = rewrite_shard(ckpt, KV_B, lambda t: t.update({KV_B: t[KV_B][:-1].clone()}))
    shape = kv_b_shape(ckpt)
    return f"{file}: tensor {KV_B} has shape [{shape[0] - 1}, {shape[1]}], the config implies {shape}"


def kv_b_shape(ckpt: Path) -> list[int]:
    cfg = json.loads((ckpt / "config.json").read_text())
    return [cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]]


def truncated(ckpt: Path) -> str:
    file = shard_of(ckpt, KV_B)
    data = file.read_bytes()
    file.write_bytes(data[:-100])
    return f"{file} is truncated: tensor "


def not_safetensors(ckpt: Path) -> str:
    file = shard_of(ckpt, KV_B)
    file.write_bytes(struct.pack("<Q", 1 << 40) + b"garbage")
    return f"{file} is not a safetensors file (header length {1 << 40} in a file of 15 bytes)"


def tensor_not_in_its_shard(ckpt: Path) -> str:
    file = rewrite_shard(ckpt, KV_B, lambda t: t.pop(KV_B))
    return f"{file}: lacks tensor {KV_B}, which {INDEX} places there"


def tensor_missing_everywhere(ckpt: Path) -> str:
    rewrite_shard(ckpt, KV_B, lambda t: t.pop(KV_B))
    index = json.loads((ckpt / INDEX).read_text())
    del index["weight_map"][KV_B]
    (ckpt / INDEX).write_text(json.dumps(index))
    return f"checkpoint '{ckpt}' lacks weights the model needs: {KV_B}"


def fp8_without_config(ckpt: Path) -> str:
    file = rewrite_shard(ckpt, KV_B, lambda t: t.update({KV_B: t[KV_B].to(torch.float8_e4m3fn)}))
    return (
        f"{file}: tensor {KV_B} is F8_E4M3; weights must be F32, BF16, F16 (F8_E4M3 only in a checkpoint whose "
        "quantization_config is fp8)"
    )


BREAKAGES = [
    no_config,
    config_not_json,
    index_not_json,
    shard_missing,
    wrong_dtype,
    wrong_shape,
    truncated,
    not_safetensors,
    tensor_not_in_its_shard,
    tensor_missing_everywhere,
    fp8_without_config,
]


@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda f: f.__name__)
def test_each_breakage_is_named_with_its_file_and_tensor(sharded, tmp_path, breakage):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sharded, ckpt)
    message = breakage(ckpt)
    with pytest.raises(ModelLoadError) as err:
        inspect_checkpoint(ckpt)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_an_intact_checkpoint_passes(sharded):
    assert (
        inspect_checkpoint(sharded).num_layers == json.loads((sharded / "config.json").read_text())["num_hidden_layers"]
    )


def test_fp8_scale_of_the_wrong_shape_is_named(tmp_path):
    ckpt = make_tiny_model(tmp_path / "fp8", fp8=True, overrides={"intermediate_size": 300})
    name = "model.layers.0.mlp.up_proj.weight"
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    assert tensors[name].dtype == torch.float8_e4m3fn and list(tensors[name + "_scale_inv"].shape) == [3, 1]
    tensors[name + "_scale_inv"] = tensors[name + "_scale_inv"][:2].clone()
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        inspect_checkpoint(ckpt)
    assert str(err.value) == (
        f"{ckpt / 'model.safetensors'}: fp8 tensor {name} needs {name}_scale_inv of shape [3, 1] (shape [2, 1] found)"
    )


@pytest.mark.parametrize(
    "breakage", [wrong_shape, wrong_dtype, shard_missing, no_config, config_not_json], ids=lambda f: f.__name__
)
def test_serve_stops_with_one_line_and_exit_2_before_binding(sharded, tmp_path, breakage):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sharded, ckpt)
    message = breakage(ckpt)
    start = time.monotonic()
    res = afd_run("serve", "--model-path", str(ckpt), "--port", str(free_port()), "--num-threads", "1", timeout=60)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("afd serve: error: " + message), res.stderr
    assert time.monotonic() - start < 30  # no rank was started and waited for
