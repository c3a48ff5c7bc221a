"""PD with the decode instance as a deployment of rank processes (colocated dp2, AFD 2 attention
+ 2 FFN ranks), the prefill instance in this process: tokens equal to the single engine's."""

from __future__ import annotations

import pytest

from afd_engine import Engine, SamplingParams
from afd_engine.disagg.transfer import mooncake_available
from afd_engine.offline_deployment import DistributedEngine
from tests.disagg.pd_helpers import COMMON, PDPair, idle_pages
from tests.engine_helpers import run_staggered, staggered_reference

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
LENGTHS = (5, 40, 17, 70, 33, 9, 26, 50)


@pytest.fixture(scope="module")
def reference(tiny_v3):
    return staggered_reference(tiny_v3, LENGTHS, GREEDY, seed=11, low=5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "decode,backend",
    [
        ({"mode": "colocated", "dp_size": 2}, "builtin"),
        ({"mode": "afd", "dp_size": 2, "ffn_ranks_per_node": 2, "micro_batches": 2}, "mooncake"),
    ],
)
def test_decode_deployments_give_the_single_engines_tokens(tiny_v3, reference, decode, backend):
    if backend == "mooncake" and mooncake_available():
        pytest.skip(f"the Mooncake Transfer Engine does not import on this machine: {mooncake_available()}")
    prompts, want = reference
    common = {**COMMON, "model_path": tiny_v3, "disaggregation_transfer_backend": backend}
    prefill = Engine(**common, disaggregation_mode="prefill")
    pd = PDPair(prefill, DistributedEngine(**common, **decode, disaggregation_mode="decode"))
    try:
        assert run_staggered(pd, prompts, GREEDY, every=2) == want
        assert all(out.finish_reason == "transferred" for out in pd.prefill_outputs.values())
        assert idle_pages(prefill)
    finally:
        pd.close()
