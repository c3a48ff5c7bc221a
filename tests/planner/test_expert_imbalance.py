"""The measured expert-rank imbalance (max / mean rank load): what it scales, what 1.0 leaves alone,
and how `afd plan deploy` reads it from --expert-imbalance or an --expert-load JSON file."""

from __future__ import annotations

import json

import pytest

from afd_engine.cli import main
from afd_engine.errors import ConfigError
from afd_engine.planner.calibration import Calibration, LinearFit
from afd_engine.planner.deploy import Deployment, estimate
from afd_engine.planner.hardware import HARDWARE
from afd_engine.planner.model_spec import MODELS
from afd_engine.planner.network import CommCase, comm_time
from afd_engine.planner.search import SearchSpace, search
from afd_engine.planner.stages import StageModel, expected_max_load

H800 = HARDWARE["H800"]
V3 = MODELS["deepseek-v3"]
OVERHEAD = H800.efficiency.layer_overhead_us
FACTORS = (1.0, 1.07, 1.5, 3.54)
DEPLOY = ("deploy", "--model", "deepseek-v3", "--mode", "colocated", "--attn-gpus", "32")


def v3(imbalance: float = 1.0, **kw) -> StageModel:
    return StageModel(V3, H800, H800, 4096, "bf16", expert_imbalance=imbalance, **kw)


@pytest.mark.parametrize("k", FACTORS)
def test_busiest_rank_computes_factor_times_the_balanced_straggler(k):
    assert v3(k).busiest_rank_rows(20_000, 16) == k * expected_max_load(20_000 * V3.topk / 16, 16)


@pytest.mark.parametrize("k", FACTORS)
def test_ffn_compute_time_scales_by_exactly_the_factor(k):
    # 32 attention GPUs x 384 sequences: ~6,000 rows per F GPU, compute-bound; shared expert on A
    dep = Deployment("afd", 32, 16, 1, 384)
    flops_us = 2 * V3.expert_params / (H800.tflops("fp8") * H800.efficiency.gemm_compute * 1e6)
    rows = expected_max_load(384 * 32 * V3.topk / 16, 16)
    assert estimate(v3(k), dep).ffn_us - OVERHEAD == pytest.approx(k * rows * flops_us, rel=1e-12)
    assert estimate(v3(k), dep).ffn_us - OVERHEAD == pytest.approx(k * (estimate(v3(), dep).ffn_us - OVERHEAD))


def test_weight_reads_and_the_shared_expert_are_not_scaled():
    # a small batch is bound by weight reads, which cover the rank's own experts however skewed
    assert v3(1.5).experts_us(64, 16) == v3().experts_us(64, 16)
    assert v3(1.5).experts_us(64, 16, shared_expert=True) == v3().experts_us(64, 16, shared_expert=True)


def test_a_calibration_scales_its_per_row_term_only():
    calib = Calibration(LinearFit(100.0, 5.0, 10), LinearFit(50.0, 2.0, 10))
    rows = v3().busiest_rank_rows(4096, 16)
    assert v3(1.5, calibration=calib).experts_us(4096, 16) == pytest.approx(50.0 + 2.0 * 1.5 * rows)


def test_traffic_into_the_busiest_rank_scales_by_the_factor():
    def comm(mode: str, k: float, symmetric: bool = False):
        case = CommCase(128, 7168, 8, 256, 32, 16 if not symmetric else 32, mode, symmetric=symmetric, imbalance=k)
        return comm_time(case, H800)

    direct, two, col = comm("direct", 1.0), comm("two-stage", 1.0), comm("direct", 1.0, symmetric=True)
    skewed_direct, skewed_two = comm("direct", 2.5), comm("two-stage", 2.5)
    skewed_col = comm("direct", 2.5, symmetric=True)
    # direct: the busiest rank's NIC takes 2.5x; what each sender sends is unchanged
    assert skewed_direct.receiver_nic_us == pytest.approx(2.5 * direct.receiver_nic_us)
    assert skewed_direct.sender_nic_us == direct.sender_nic_us
    assert skewed_direct.inter_node_bytes == direct.inter_node_bytes
    # two-stage: the relays' NICs carry node loads (relay = sender mod R); the scale-up hop into the rank scales
    assert skewed_two.receiver_nic_us == two.receiver_nic_us
    assert skewed_two.scaleup_us == pytest.approx(2.5 * two.scaleup_us)
    # colocated EP: the busiest rank receives 2.5x over its NIC and its node's scale-up links
    assert skewed_col.receiver_nic_us == pytest.approx(2.5 * col.receiver_nic_us)
    assert skewed_col.scaleup_us == pytest.approx(2.5 * col.scaleup_us)
    assert skewed_col.sender_nic_us == col.sender_nic_us


def test_balanced_reproduces_the_outputs_before_the_factor_existed():
    # TPOT, F, dispatch and combine us this model computed before it took the factor (rel 1e-12: libm
    # rounding only); the first deployment is compute-bound on F, the others bound by weight reads
    golden = [
        (
            Deployment("afd", 32, 16, 1, 384),
            156.44324736215464,
            519.4489703389733,
            303.16829800055314,
            568.8873062864777,
        ),
        (
            Deployment("afd", 32, 16, 2, 192, "two-stage", "ffn"),
            63.631208977021,
            369.26791641791056,
            90.79207450013828,
            157.22182657161943,
        ),
        (Deployment("afd", 32, 16, 3, 192, "direct"), 80.24156797735178, 350.48745074626873, 209.44, 387.2064),
        (Deployment("colocated", 32, 0, 2, 128, "direct"), 64.99103889259648, 200.24372537313437, 91.04, 157.7024),
    ]
    default = StageModel(V3, H800, H800, 4096, "bf16")
    for dep, *expected in golden:
        e = estimate(v3(1.0), dep)
        assert e == estimate(default, dep)
        assert [e.tpot_ms, e.ffn_us, e.dispatch_us, e.combine_us] == pytest.approx(expected, rel=1e-12)
    step3 = StageModel(MODELS["step3"], H800, H800, 4096, "fp8", expert_imbalance=1.0)
    best = search(step3, "afd", 50, SearchSpace(attn_gpus=(16,), ffn_gpus=(16,), micro_batches=(3,)))[0]
    assert best.deployment.seqs_per_gpu == 401 and best.tokens_per_gpu_s == pytest.approx(4011.5956258164106, rel=1e-12)


# --- the command line ---------------------------------------------------------------------------


def deploy_json(capsys, *args: str) -> dict:
    assert main(["plan", *DEPLOY, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def write(tmp_path, content) -> str:
    path = tmp_path / "load.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_cli_default_and_explicit_one_match_and_say_so(capsys):
    default, one = deploy_json(capsys), deploy_json(capsys, "--expert-imbalance", "1.0")
    assert default.pop("expert_imbalance_source") == "default: balanced routing"
    assert one.pop("expert_imbalance_source") == "--expert-imbalance"
    assert default == one and one["expert_imbalance"] == 1.0
    assert main(["plan", *DEPLOY, "--expert-imbalance", "1.25"]) == 0
    assert "expert-rank imbalance (max / mean load): 1.25 (--expert-imbalance)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content,key,value",
    [
        ({"imbalance_before": 3.54, "imbalance_after": 1.25}, "imbalance_after", 1.25),  # bench_eplb.py --json
        ({"imbalance_after": 1.25, "imbalance": 3.0}, "imbalance_after", 1.25),  # after rebalancing wins
        ({"imbalance": 2, "rank_loads": [10, 5]}, "imbalance", 2.0),  # GET /expert_load, afd expert-load
    ],
)
def test_cli_reads_the_factor_from_either_key(tmp_path, capsys, content, key, value):
    path = write(tmp_path, content)
    from_file = deploy_json(capsys, "--expert-load", path)
    from_flag = deploy_json(capsys, "--expert-imbalance", str(value))
    assert from_file.pop("expert_imbalance_source") == f"{path}: {key}"
    from_flag.pop("expert_imbalance_source")
    assert from_file == from_flag and from_file["expert_imbalance"] == value
    assert from_file["tokens_per_gpu_s"] < deploy_json(capsys)["tokens_per_gpu_s"]


@pytest.mark.parametrize(
    "content,message",
    [
        ({"imbalance_before": 3.5}, "no key 'imbalance_after' or 'imbalance' (keys: imbalance_before)"),
        ({}, "no key 'imbalance_after' or 'imbalance' (keys: none)"),
        ({"imbalance_after": 0.9}, "'imbalance_after' must be a number >= 1.0"),
        ({"imbalance": "high"}, "'imbalance' must be a number >= 1.0"),
        ({"imbalance": None}, "'imbalance' must be a number >= 1.0"),
        ([1.2], "expected a JSON object with key 'imbalance_after' or 'imbalance'"),
        ("{imbalance: 1.2", "not a JSON file"),
    ],
)
def test_cli_file_errors_name_the_file_and_the_key(tmp_path, capsys, content, message):
    path = write(tmp_path, content)
    assert main(["plan", *DEPLOY, "--expert-load", path]) == 2
    err = capsys.readouterr().err
    assert f"afd plan deploy: error: --expert-load {path}: {message}" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["--expert-imbalance", "0.99"], "--expert-imbalance must be a number >= 1.0 (max over mean"),
        (["--expert-imbalance", "nan"], "--expert-imbalance must be a number >= 1.0"),
        (["--expert-load", "/nonexistent/load.json"], "--expert-load /nonexistent/load.json: no such file"),
    ],
)
def test_cli_bad_values_exit_2_with_one_line(capsys, args, message):
    assert main(["plan", *DEPLOY, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_flag_and_file_are_exclusive(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *DEPLOY, "--expert-imbalance", "1.5", "--expert-load", write(tmp_path, {"imbalance": 2})])
    assert exc.value.code == 2
    assert "argument --expert-load: not allowed with argument --expert-imbalance" in capsys.readouterr().err


def test_python_api_rejects_a_factor_below_one():
    with pytest.raises(ConfigError, match="--expert-imbalance must be a number >= 1.0"):
        v3(0.5)
    with pytest.raises(ConfigError, match="CommCase.imbalance must be a number >= 1.0"):
        comm_time(CommCase(128, 7168, 8, 256, 32, 16, imbalance=0.5), H800)
