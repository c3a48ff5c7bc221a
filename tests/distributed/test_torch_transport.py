"""--transport torch: the data plane over torch.distributed (gloo on these CPUs, NCCL between GPU
ranks) gives every deployment the tokens of the single engine, and the same bytes as shared memory
for the lossy wires (fp8 dispatch, bf16 combine). Killing a rank and several machines: see
test_serve_deployments.py and test_launch_roles.py, which run over both transports."""

from __future__ import annotations

import pytest
import torch

from afd_engine import SamplingParams, make_engine
from tests.engine_helpers import run_staggered, staggered_reference

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
LOGPROBS = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
LENGTHS = (1, 5, 17, 40, 64)

DEPLOYMENTS = {
    "afd 2A 2x2 mb3 two-stage": dict(mode="afd", dp_size=2, ffn_nodes=2, ffn_ranks_per_node=2, micro_batches=3),
    "afd 1A 1x2 mb2 direct, rebalancing 2 redundant": dict(
        mode="afd",
        dp_size=1,
        ffn_ranks_per_node=2,
        micro_batches=2,
        dispatch="direct",
        ep_num_redundant_experts=2,
        enable_eplb=True,
        eplb_rebalance_num_iterations=3,
    ),
    "colocated dp2 mb2": dict(mode="colocated", dp_size=2, micro_batches=2),
}


@pytest.fixture(scope="module")
def reference(tiny_v3):
    return staggered_reference(tiny_v3, LENGTHS, GREEDY, seed=5, low=5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_torch_transport_gives_the_single_engines_tokens(name, tiny_v3, reference):
    batch, expected = reference
    flags = DEPLOYMENTS[name]
    with make_engine(model_path=tiny_v3, transport="torch", comm_timeout=30, dispatch_dtype="fp32", **flags) as engine:
        rounds = 3 if flags.get("enable_eplb") else 1  # placements switch every 3 steps, mid-generation
        for _ in range(rounds):
            assert run_staggered(engine, batch, GREEDY, every=2) == expected, name


@pytest.mark.timeout(300)
def test_fp8_and_bf16_wires_carry_the_same_bytes_as_shared_memory(tiny_v3, reference):
    batch = reference[0]
    flags = dict(mode="afd", dp_size=2, ffn_nodes=2, dispatch_dtype="fp8", combine_dtype="bf16", comm_timeout=30)
    outs = {}
    for transport in ("shm", "torch"):
        with make_engine(model_path=tiny_v3, transport=transport, **flags) as engine:
            outs[transport] = engine.generate(prompt_token_ids=batch, sampling_params=LOGPROBS)
    for shm, torch_ in zip(outs["shm"], outs["torch"]):
        assert torch_.token_ids == shm.token_ids
        assert [lp.top_logprobs for lp in torch_.logprobs] == [lp.top_logprobs for lp in shm.logprobs]


def test_ranks_sharing_a_gpu_are_refused_before_nccl_refuses_them(tiny_v3, monkeypatch):
    from afd_engine.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    flags = dict(mode="afd", dp_size=1, transport="torch", device="cuda", gpu_id_step=0)
    with pytest.raises(ConfigError) as err:
        make_engine(model_path=tiny_v3, **flags)
    assert str(err.value) == (
        "--transport torch with --gpu-id-step=0 puts 2 ranks on one GPU, which NCCL refuses; give each rank its "
        "own GPU (--gpu-id-step 1) or use --transport auto"
    )
