"""Models are built as shapes without their weight initializers, and a rank process starts without
importing dynamo (1.2 s it never needs)."""

from __future__ import annotations

import subprocess
import sys

import torch

from afd_engine.models.meta import on_meta
from kernels.native import assume_constant_result


def test_the_constant_result_mark_is_torchs_own():
    import torch._dynamo

    def ours():
        return 1

    def theirs():
        return 1

    assume_constant_result(ours)
    torch._dynamo.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) == {"_dynamo_marked_constant": True}


def test_on_meta_skips_inits_and_puts_them_back():
    before = torch.nn.init.normal_
    with on_meta():
        layer = torch.nn.Linear(3, 4)
        emb = torch.nn.Embedding(5, 2)
    assert layer.weight.is_meta and emb.weight.shape == (5, 2)
    assert torch.nn.init.normal_ is before
    assert torch.nn.init.normal_(torch.zeros(1000)).std() > 0.5  # a real init again


def test_an_engine_starts_without_importing_dynamo(tiny_v3):
    code = (
        "import sys; from afd_engine.engine import Engine; "
        f"e = Engine(model_path={tiny_v3!r}, num_threads=1); e.generate(prompt_token_ids=[[1, 2]]); "
        "assert 'torch._dynamo' not in sys.modules, 'dynamo was imported'"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
