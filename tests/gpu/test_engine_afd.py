"""AFD 1 attention + 1 FFN rank on the GPU (processes; triton backends, fp32) give the single
engine's tokens, over each data plane: auto (shared memory through the host, both ranks on the one
GPU with --gpu-id-step 0) and torch (NCCL with a GPU per rank; gloo on the CPU). The ranks' stderr
is pytest's, shown with a failure."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import engines

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("transport", ["auto", "torch"])
def test_afd_1a1f_gives_the_single_engine_tokens(single_run, checkpoint, device, tiny, transport):
    try:
        import zmq  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"pyzmq is missing ({exc}): deployments need it; see benchmarks/kernels/gpu_wheels.sh"
        ) from exc
    step = 1 if transport == "torch" else 0  # NCCL needs a GPU per rank
    if step and device.type == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL refuses two ranks on one GPU; this machine has one")
    single = single_run("deepseek_v3", "float32", "triton")
    deployment = dict(mode="afd", dp_size=1, ffn_nodes=1, ffn_ranks_per_node=1, gpu_id_step=step, transport=transport)
    prompts = engines.fixed_prompts(tiny)
    afd = engines.greedy(checkpoint("deepseek_v3"), device, prompts, "float32", "triton", tiny, **deployment)
    assert afd.tokens == single.tokens
