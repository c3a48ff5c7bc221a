"""A checkpoint whose tokenizer only its own Python code builds (Kimi-K2's tiktoken tokenizer:
`tokenization_kimi.py` named by `auto_map`, `tiktoken.model`, no `tokenizer.json`) is refused in one
line naming the file, before any weight is read, in the API and through `afd serve`; the code never
runs. One that also declares a tokenizer transformers provides loads without it."""

from __future__ import annotations

import json

import pytest

from afd_engine import Engine
from afd_engine.checkpoint_tokenizer import load_tokenizer
from afd_engine.errors import ModelLoadError
from afd_engine.tiny_model import make_tiny_model
from tests.process_helpers import afd_run, free_port

KIMI_AUTO_MAP = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
# the stub fails loudly if anything imports it
RAN = "raise RuntimeError('tokenization_kimi.py ran')\n"


def message(path, code: str = "tokenization_kimi.py") -> str:
    return (
        f"the tokenizer of {str(path)!r} needs remote code ({code}), which the engine does not run; give the "
        "checkpoint a tokenizer.json and tokenizer_class PreTrainedTokenizerFast in tokenizer_config.json"
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "ckpt", arch="deepseek_v3")


def kimi_like(tiny, out, tokenizer_config: dict, keep_fast: bool = False):
    """The tiny checkpoint with Kimi-K2's tokenizer files in place of its own; the weights replaced
    by bytes that are not safetensors, so that reading any weight fails differently."""
    out.mkdir()
    for f in tiny.iterdir():
        if f.name != "tokenizer.json" or keep_fast:
            (out / f.name).write_bytes(f.read_bytes())
    settings = json.loads((tiny / "tokenizer_config.json").read_text())
    settings = {k: v for k, v in {**settings, **tokenizer_config}.items() if v is not None}  # None: key removed
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    (out / "tokenization_kimi.py").write_text(RAN)
    (out / "tiktoken.model").write_text("placeholder: tiktoken ranks, base64 token and rank per line\n")
    if not keep_fast:
        (out / "model.safetensors").write_bytes(b"not read")
    return out


@pytest.mark.parametrize(
    "tokenizer_config, code",
    [
        ({"tokenizer_class": "TikTokenTokenizer", "auto_map": KIMI_AUTO_MAP}, "tokenization_kimi.py"),
        (
            {"tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": "org/kimi--tokenization_k.T"}},
            "tokenization_k.py",
        ),
        ({"tokenizer_class": None, "auto_map": KIMI_AUTO_MAP}, "tokenization_kimi.py"),
        ({"tokenizer_class": "TikTokenTokenizer"}, "tokenization_kimi.py"),  # no auto_map, no tokenizer.json
    ],
    ids=["kimi", "remote-repo", "no-class", "no-auto-map"],
)
def test_a_remote_code_tokenizer_is_refused_in_one_line_before_the_weights(tiny, tmp_path, tokenizer_config, code):
    ckpt = kimi_like(tiny, tmp_path / "kimi", tokenizer_config)
    with pytest.raises(ModelLoadError) as err:
        Engine(model_path=str(ckpt), num_threads=1)
    assert str(err.value) == message(ckpt, code)


def test_serve_prints_the_one_line_and_exits_2(tiny, tmp_path):
    ckpt = kimi_like(tiny, tmp_path / "kimi", {"tokenizer_class": "TikTokenTokenizer", "auto_map": KIMI_AUTO_MAP})
    res = afd_run("serve", "--model-path", str(ckpt), "--port", str(free_port()), "--num-threads", "1", timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == ["afd serve: error: " + message(ckpt)]


def test_a_tokenizer_transformers_provides_loads_beside_the_remote_code(tiny, tmp_path):
    """auto_map still names the code, but tokenizer_class and tokenizer.json are transformers' own:
    nothing is refused and the stub (which raises when imported) never runs."""
    ckpt = kimi_like(tiny, tmp_path / "kimi", {"auto_map": KIMI_AUTO_MAP}, keep_fast=True)
    assert json.loads((ckpt / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    tokenizer = load_tokenizer(ckpt)
    assert tokenizer.decode(tokenizer.encode("def f(x):", add_special_tokens=False)) == "def f(x):"
