"""The performance model: AFD and colocated deployments at cluster scale (see README.md here).

from afd_engine.planner import StageModel, SearchSpace, get_hardware, get_model, search
h800 = get_hardware("H800")
sm = StageModel(get_model("step3"), h800, h800, context=4096, attn_dtype="fp8")  # expert_imbalance=1.3: skew
best = search(sm, "afd", tpot_slo_ms=50)[0]      # an Estimate: tpot_ms, tokens_per_gpu_s, deployment, ...
"""

from afd_engine.planner.calibration import Calibration, calibrate
from afd_engine.planner.deploy import Deployment, Estimate, estimate
from afd_engine.planner.expert_load import load_expert_imbalance
from afd_engine.planner.hardware import HARDWARE, Efficiency, Hardware, get_hardware, load_hardware_file
from afd_engine.planner.model_spec import MODELS, ModelSpec, get_model
from afd_engine.planner.network import CommCase, CommTime, comm_time
from afd_engine.planner.search import SearchSpace, search
from afd_engine.planner.sparsity import min_sparsity, stage_budget_us
from afd_engine.planner.stages import StageModel

__all__ = [
    "Calibration",
    "CommCase",
    "CommTime",
    "Deployment",
    "Efficiency",
    "Estimate",
    "HARDWARE",
    "Hardware",
    "MODELS",
    "ModelSpec",
    "SearchSpace",
    "StageModel",
    "calibrate",
    "comm_time",
    "estimate",
    "get_hardware",
    "get_model",
    "load_expert_imbalance",
    "load_hardware_file",
    "min_sparsity",
    "search",
    "stage_budget_us",
]
