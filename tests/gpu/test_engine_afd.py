"""AFD 1 attention + 1 FFN rank on the GPU (processes; triton backends, fp32) give the single
engine's tokens, over each data plane: shared memory with both ranks on the one GPU
(--gpu-id-step 0), its payloads in GPU memory shared by CUDA IPC and decode steps replayed from
the attention rank's stage graphs and the FFN rank's expert graphs (the default on a GPU), or
through the host without graphs (--host-payloads --disable-cuda-graph); and torch (NCCL with a GPU
per rank; gloo on the CPU). On the CPU the first runs the static path of the graphs eagerly
(--static-decode). The ranks' stderr is pytest's, shown with a failure."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import engines

pytestmark = pytest.mark.gpu


PLANES = {
    "shm device payloads, graphs": dict(transport="auto"),
    "shm host payloads, eager": dict(transport="auto", host_payloads=True, disable_cuda_graph=True),
    "torch": dict(transport="torch"),
}


@pytest.mark.parametrize("plane", list(PLANES))
def test_afd_1a1f_gives_the_single_engine_tokens(single_run, checkpoint, device, tiny, plane):
    try:
        import zmq  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"pyzmq is missing ({exc}): deployments need it; see benchmarks/kernels/gpu_wheels.sh"
        ) from exc
    flags = dict(PLANES[plane])
    if device.type != "cuda" and "disable_cuda_graph" not in flags:
        flags["static_decode"] = True
    step = 1 if flags["transport"] == "torch" else 0  # NCCL needs a GPU per rank
    if step and device.type == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL refuses two ranks on one GPU; this machine has one")
    single = single_run("deepseek_v3", "float32", "triton")
    deployment = dict(mode="afd", dp_size=1, ffn_nodes=1, ffn_ranks_per_node=1, gpu_id_step=step, **flags)
    prompts = engines.fixed_prompts(tiny)
    afd = engines.greedy(checkpoint("deepseek_v3"), device, prompts, "float32", "triton", tiny, **deployment)
    assert afd.tokens == single.tokens
