"""How the engine tests judge tokens against transformers (engines.agreement); no GPU needed."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import engines


def test_agreement_counts_tokens_up_to_the_first_difference():
    logp = torch.log_softmax(torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.9], [1.0, 0.0, 5.0]]), -1)
    tokens = [0, 2, 2]  # position 1 is transformers' second choice, 0.1 below its first
    out = engines.agreement([logp], [tokens], [[float(logp[i, t]) + 0.01 for i, t in enumerate(tokens)]])
    assert (out["tokens"], out["matched"], out["argmax_agree"]) == (3, 1, 2)
    assert out["max_logprob_diff"] == pytest.approx(0.01, abs=1e-6)
    first = out["prompts"][0]["first_difference"]
    assert (first["position"], first["engine"], first["transformers"]) == (1, 2, 1)
    assert first["top2_gap"] == pytest.approx(0.1, abs=1e-5)
