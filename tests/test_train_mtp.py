"""`afd train-tiny --mtp-only`: an MTP head trained on an existing checkpoint leaves the main tensors
bit for bit, is saved in DeepSeek's layout as layer `num_hidden_layers`, loads in the engine
(`load_model(..., mtp=True)`) and computes there what the training module computes. The source is a
small random checkpoint, trained for a few steps: these tests check the plumbing, not the quality
(tests/test_trained_model.py checks the shipped head's).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from afd_engine.model_config import ModelConfig
from afd_engine.models import load_model
from afd_engine.models.forward_batch import ForwardBatch, SeqChunk
from afd_engine.runtime.kv_cache import KVPool
from afd_engine.tiny_model import make_tiny_model, tiny_weight_specs
from afd_engine.train_tiny import (
    MTP_README_HEADING,
    MTPModule,
    TrainConfig,
    load_checkpoint,
    main_forward,
    main_train_tiny,
    train,
)

PAGE = 16


def engine_logits(path: Path, ids: list[int], model=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's main logits [T, V] of `ids` and its MTP module's [T-1, V] (position i: token
    i+2 from the main model's hidden state at i and token i+1), in float32."""
    cfg = ModelConfig.from_pretrained(path)
    model = model or load_model(cfg, path, torch.float32, mtp=True)
    pages = -(-len(ids) // PAGE)
    pool = KVPool(cfg.num_layers + 1, cfg.kv_cache_dim, pages, PAGE, 1, pages, torch.float32)
    row = pool.open_row()
    assert pool.grow(row, len(ids))
    fb = ForwardBatch.build([SeqChunk(row, 0, ids)], [], pool.page_table, PAGE)
    logits, hidden = model(fb, pool.cache, torch.arange(len(ids)), hidden=True)
    # the MTP module's own cache layer, the same positions 0 .. T-2
    mtp_fb = ForwardBatch.build([SeqChunk(row, 0, ids[1:])], [], pool.page_table, PAGE)
    embeds = model.model.embed_tokens(torch.tensor(ids[1:]))
    return logits, model.mtp[0](embeds, hidden[:-1], mtp_fb, pool.cache, torch.arange(len(ids) - 1))


def train_head(out: Path, source: Path, *flags: str) -> dict:
    argv = [str(out), "--mtp-only", "--from", str(source), "--mtp-steps", "3", "--threads", "1", *flags]
    assert main_train_tiny(argv) == 0
    return json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("source"), arch="deepseek_v3", seed=3, dtype="bfloat16")


@pytest.fixture(scope="module")
def trained(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained")
    train_head(out, source)
    return out


def test_the_head_is_added_and_the_main_tensors_stay_bit_for_bit(source, trained, capsys):
    before, after = load_file(str(source / "model.safetensors")), load_file(str(trained / "model.safetensors"))
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
    config = json.loads((source / "config.json").read_text())
    assert json.loads((trained / "config.json").read_text()) == {**config, "num_nextn_predict_layers": 1}
    n = config["num_hidden_layers"]
    expected = {name: shape for name, shape, _ in tiny_weight_specs({**config, "num_nextn_predict_layers": 1})}
    head = {name: t for name, t in after.items() if name not in before}
    assert {name: tuple(t.shape) for name, t in head.items()} == {
        name: shape for name, shape in expected.items() if name.startswith(f"model.layers.{n}.")
    }
    bias = f"model.layers.{n}.mlp.gate.e_score_correction_bias"
    assert head.pop(bias).equal(torch.zeros(config["n_routed_experts"]))  # float32 zeros
    assert all(t.dtype == torch.bfloat16 for t in head.values())
    # the embedding and the output head are the main model's
    assert torch.equal(head[f"model.layers.{n}.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert torch.equal(head[f"model.layers.{n}.shared_head.head.weight"], before["lm_head.weight"])
    assert (trained / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    readme = (trained / "README.md").read_text()
    assert readme.startswith(MTP_README_HEADING) and "acceptance proxy" in readme and "2026-11-28" in readme


def test_the_engine_computes_what_training_computed(trained):
    ids = Tokenizer.from_file(str(trained / "tokenizer.json")).encode("A list is a sequence of items. " * 4).ids
    _, ours = engine_logits(trained, ids)
    config, tensors, main = load_checkpoint(trained)
    module = MTPModule(config, main)
    module.load_checkpoint(tensors)
    with torch.no_grad():
        hidden, _ = main_forward(main, torch.tensor(ids)[None])
        ref = module(hidden[:, :-1], torch.tensor(ids[1:])[None])[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_training_is_deterministic_and_in_place_replaces_an_older_head(source, trained, tmp_path):
    again = train_head(tmp_path / "again", source)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (trained / "model.safetensors").read_bytes()
    # in place, another seed: the head is replaced (one of it), the main tensors are still the source's
    inplace = tmp_path / "inplace"
    shutil.copytree(trained, inplace)
    assert main_train_tiny([str(inplace), "--mtp-only", "--mtp-steps", "3", "--threads", "1", "--seed", "1"]) == 0
    assert json.loads((inplace / "config.json").read_text()) == again
    before, old, new = (load_file(str(p / "model.safetensors")) for p in (source, trained, inplace))
    assert new.keys() == old.keys()
    assert all(torch.equal(new[name], t) for name, t in before.items())
    changed = {name for name in old if not torch.equal(old[name], new[name])}
    assert changed and all(name.startswith(f"model.layers.{again['num_hidden_layers']}.") for name in changed)
    assert (inplace / "README.md").read_text().count(MTP_README_HEADING) == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--from", "x"], "--from reads the checkpoint that --mtp-only adds a head to"),
        (["--mtp-only", "--mtp-steps", "0"], "--mtp-steps must be at least 1"),
    ],
)
def test_flags_that_do_not_go_together_are_refused(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        main_train_tiny([str(tmp_path), *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_train_tiny_trains_the_main_model_then_the_head(tmp_path):
    result = train(tmp_path, TrainConfig(steps=2, mtp_steps=2, batch_size=2, seq_len=64, threads=1))
    assert result["mtp"]["steps"] == 2 and 0 <= result["mtp"]["acceptance"] <= 1
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.mtp_layers == 1
    load_model(cfg, tmp_path, torch.float32, mtp=True)
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("# tiny-deepseek-v3-pydoc") and readme.count(MTP_README_HEADING) == 1
