"""bench_vs_vllm and its modules: the script's own logic (arguments, checkpoint config, server
commands, greedy comparison, the table). Nothing here starts a server or needs vLLM installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd_engine.tiny_model import build_tiny_config, tiny_weight_specs
from afd_engine.tiny_tokenizer import TokenizerInfo
from benchmarks import bench_serving
from benchmarks import dsv3_checkpoint as ckpt
from benchmarks.lib import greedy_agreement as greedy
from benchmarks.lib import load_levels as levels
from benchmarks.lib import peer_servers as peers
from tests.process_helpers import load_bench


@pytest.fixture(scope="module")
def bvv():
    return load_bench("bench_vs_vllm.py")


def test_defaults_reproduce_the_headline_run(bvv):
    args = bvv.parse_args(["--cores", "0-1"])
    assert args.engines == ["afd", "vllm"] and args.concurrency == [1, 8, 32]
    assert args.core_list == [0, 1] and args.vllm_python == str(Path.home() / "vllm-venv/bin/python")
    assert [levels.num_prompts(c, args) for c in args.concurrency] == [16, 32, 128]


def test_quick_and_normalised_arguments(bvv):
    args = bvv.parse_args(["--quick", "--cores", "1", "--engines", "vllm", "afd", "--concurrency", "8", "2"])
    assert args.concurrency == [1, 4] and (args.input_len, args.output_len) == (8, 8)
    assert args.engines == ["afd", "vllm"] and args.core_list == [1]
    args = bvv.parse_args(["--concurrency", "8", "2", "8"])
    assert args.concurrency == [2, 8]
    for bad in (["--cores", "3-1"], ["--cores", "a"], ["--concurrency", "0"], ["--output-len", "0"]):
        with pytest.raises(SystemExit):
            bvv.parse_args(bad)


def test_cpu_lists_round_trip():
    assert peers.parse_cores("0-2,5, 7-8") == [0, 1, 2, 5, 7, 8]
    assert peers.format_cores([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    assert peers.format_cores([3]) == "3"


def test_benchmark_checkpoint_has_deepseek_v3_attention():
    info = TokenizerInfo(vocab_size=512, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config = build_tiny_config("deepseek_v3", info, overrides=ckpt.BENCH_MODEL_OVERRIDES)
    assert config["kv_lora_rank"] == 512 and config["qk_rope_head_dim"] == 64
    assert config["qk_nope_head_dim"] == 128 and config["v_head_dim"] == 128 and config["q_lora_rank"]
    assert ckpt.has_dsv3_attention(config)
    shapes = {name: shape for name, shape, _ in tiny_weight_specs(config)}
    heads = config["num_attention_heads"]
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, config["hidden_size"])
    assert shapes["model.layers.0.self_attn.kv_b_proj.weight"] == (heads * (128 + 128), 512)
    tiny = build_tiny_config("deepseek_v3", info)
    assert not ckpt.has_dsv3_attention(tiny)  # the default tiny preset is what vLLM refuses


def test_an_existing_checkpoint_is_reused_not_rewritten(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"kv_lora_rank": 32, "qk_rope_head_dim": 8}))
    assert ckpt.prepare_model(str(tmp_path), tmp_path / "unused") == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert "DeepSeek-V3's attention dimensions" in capsys.readouterr().err


def test_both_servers_get_the_same_cores_and_model():
    model, cores = Path("/m"), [0, 1]
    afd = peers.afd_spec("/py", model, 1234, cores)
    assert afd.cmd[:4] == ["/py", "-m", "afd_engine.cli", "serve"]
    assert afd.cmd[afd.cmd.index("--num-threads") + 1] == "2" and afd.cmd[afd.cmd.index("--model-path") + 1] == "/m"
    vllm = peers.vllm_spec("/v/py", model, 1235, cores, kv_cache_gib=3, preload="/lib/a.so")
    assert vllm.cmd[:3] == ["/v/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert vllm.cmd[vllm.cmd.index("--model") + 1] == "/m" and vllm.cmd[vllm.cmd.index("--dtype") + 1] == "float32"
    assert vllm.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and vllm.env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert vllm.env["LD_PRELOAD"] == "/lib/a.so"
    assert "LD_PRELOAD" not in peers.vllm_spec("/v/py", model, 1, cores, 2).env
    for spec in (afd, vllm):
        assert spec.cmd[spec.cmd.index("--served-model-name") + 1] == peers.SERVED_NAME


def test_afd_replicas_split_the_cores_threads(bvv):
    spec = peers.afd_spec("/py", Path("/m"), 1234, [0, 1, 2, 3], replicas=2)
    assert spec.cmd[spec.cmd.index("--dp-size") + 1] == "2"
    assert spec.cmd[spec.cmd.index("--num-threads") + 1] == "2"
    assert spec.cmd[spec.cmd.index("--mode") + 1] == "single"
    assert "--dp-size" not in peers.afd_spec("/py", Path("/m"), 1234, [0, 1]).cmd
    assert bvv.parse_args(["--afd-replicas", "2", "--cores", "0-1"]).afd_replicas == 2
    with pytest.raises(SystemExit):
        bvv.parse_args(["--afd-replicas", "0"])


def test_load_is_greedy_fixed_length_and_seeded():
    args = bench_serving.parse_args(levels.load_argv("http://h:1", 8, 32, 16, 64, seed=9))
    assert (args.backend, args.dataset_name, args.temperature, args.random_range_ratio) == (
        "completions",
        "random-ids",
        0.0,
        1.0,
    )
    assert (args.max_concurrency, args.num_prompts, args.random_input_len, args.random_output_len) == (8, 32, 16, 64)
    assert args.seed == 9 and args.model == peers.SERVED_NAME


def test_greedy_requests_and_comparison(bvv):
    prompts = greedy.agreement_prompts(3, 5)
    assert prompts == greedy.agreement_prompts(3, 5) and all(len(p) == 5 and min(p) >= 5 for p in prompts)
    path, body = greedy.greedy_request("afd", [7, 8], 4)
    assert path == "/generate" and body["sampling_params"]["temperature"] == 0.0
    path, body = greedy.greedy_request("vllm", [7, 8], 4)
    assert path == "/v1/completions" and body["return_token_ids"] and body["prompt"] == [7, 8]
    assert greedy.greedy_ids("afd", {"output_ids": [1, 2]}) == [1, 2]
    assert greedy.greedy_ids("vllm", {"choices": [{"token_ids": [3]}]}) == [3]

    assert greedy.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert greedy.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert greedy.first_divergence([1, 2], [1, 2, 3]) == 2
    agreement = greedy.compare_greedy([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 0, 6]])
    assert agreement == {
        "prompts": 2,
        "identical": 1,
        "first_divergence": [None, 1],
        "matching_tokens": 4,
        "tokens": 6,
    }
    assert "1 of 2 outputs token-identical" in bvv.format_agreement(agreement)


def test_table_rows_and_ratio(bvv):
    def point(conc, tok_s, tpot, ttft=10.0, e2e=100.0):
        return {"concurrency": conc, "output_tok_s": tok_s, "tpot_p50_ms": tpot, "ttft_p50_ms": ttft, "e2e_p50_ms": e2e}

    rows = bvv.comparison_rows(
        [point(1, 100.0, 9.0), point(32, 2400.0, 12.0)],
        [point(1, 50.0, 19.0), point(8, 10.0, 1.0), point(32, 0.0, 1)],
    )
    assert [r["concurrency"] for r in rows] == [1, 8, 32]
    assert rows[0]["ratio_afd_over_vllm"] == 2.0 and rows[0]["vllm_tpot_p50_ms"] == 19.0
    assert rows[0]["afd_e2e_p50_ms"] == 100.0 and not rows[0]["vllm_tpot_bursty"]
    assert rows[1]["afd_tok_s"] is None and rows[1]["ratio_afd_over_vllm"] is None
    assert rows[2]["ratio_afd_over_vllm"] is None  # no ratio over a zero
    lines = bvv.format_table(rows).splitlines()
    assert len(lines) == 4 and "afd/vllm" in lines[0]
    assert lines[1].split() == ["1", "100.0", "50.0", "2.000", "9.00", "19.00"]
    assert lines[2].split() == ["8", "-", "10.0", "-", "-", "1.00"]
    assert lines[3].split()[:3] == ["32", "2,400.0", "0.0"]


def test_a_burst_at_the_end_marks_the_tpot(bvv):
    # 128 tokens, the first after 500 of 640 ms: TPOT would be ~1 ms whatever the decode speed
    assert bvv.bursty({"ttft_p50_ms": 500.0, "e2e_p50_ms": 640.0})
    assert not bvv.bursty({"ttft_p50_ms": 30.0, "e2e_p50_ms": 1000.0})
    afd = {"concurrency": 1, "output_tok_s": 120.0, "tpot_p50_ms": 8.0, "ttft_p50_ms": 30.0, "e2e_p50_ms": 1000.0}
    vllm = {"concurrency": 1, "output_tok_s": 200.0, "tpot_p50_ms": 0.02, "ttft_p50_ms": 500.0, "e2e_p50_ms": 640.0}
    rows = bvv.comparison_rows([afd], [vllm])
    assert rows[0]["vllm_tpot_bursty"] and not rows[0]["afd_tpot_bursty"]
    lines = bvv.format_table(rows).splitlines()
    assert lines[1].split()[-2:] == ["8.00", "0.02*"] and lines[2].startswith("* TTFT p50")


def test_missing_vllm_python_is_a_usage_error(bvv, tmp_path, capsys):
    assert bvv.main(["--vllm-python", str(tmp_path / "nope"), "--json", str(tmp_path / "o.json")]) == 2
    assert "no python at" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_other_work_is_busy_time_not_spent_by_the_measurement():
    before = peers.CpuSample(wall=10.0, busy=100.0, ours=40.0)
    # 2 s on 2 cores: 3.5 s busy, 3 s of it ours -> 0.5 s of 4 s was other work
    after = peers.CpuSample(wall=12.0, busy=103.5, ours=43.0)
    assert peers.other_work_share(before, after, n_cores=2) == pytest.approx(0.125)
    assert peers.other_work_share(before, peers.CpuSample(12.0, 101.0, 43.0), 2) == 0.0  # never negative
    assert peers.other_work_share(None, after, 2) is None
    sample = peers.cpu_sample([0], session=None)
    assert sample is None or sample.busy >= 0 and sample.ours > 0


def test_vllm_preload_resolution(tmp_path, monkeypatch):
    python = tmp_path / "venv" / "bin" / "python"
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    monkeypatch.setattr(peers, "TCMALLOC_PATHS", (str(tmp_path / "missing.so"), str(tcmalloc)))
    assert peers.resolve_preload("auto", str(python)) == ""
    tcmalloc.write_bytes(b"")
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_bytes(b"")
    assert peers.resolve_preload("auto", str(python)) == f"{tcmalloc}:{tmp_path}/venv/lib/libiomp5.so"
    assert peers.resolve_preload("none", str(python)) == ""
    assert peers.resolve_preload("/x.so", str(python)) == "/x.so"


def test_repeats_use_fresh_prompts_and_the_fastest_is_reported(bvv):
    args = bvv.parse_args(["--seed", "5"])
    seeds = {levels.load_seed(args, c, r) for c in args.concurrency for r in range(args.repeats)}
    assert len(seeds) == len(args.concurrency) * args.repeats == 9
    samples = [
        {"concurrency": 8, "output_tok_s": 90.0, "tpot_p50_ms": 30.0, "failed": 0},
        {"concurrency": 8, "output_tok_s": 120.0, "tpot_p50_ms": 20.0, "failed": 1},
        {"concurrency": 8, "output_tok_s": 100.0, "tpot_p50_ms": 25.0, "failed": 0},
    ]
    best = levels.best_point(samples)
    assert best["output_tok_s"] == 120.0 and best["tpot_p50_ms"] == 20.0  # TPOT of the same repeat
    assert best["samples_tok_s"] == [90.0, 120.0, 100.0] and best["failed"] == 1
    assert bvv.parse_args(["--quick"]).repeats == 1


def test_the_servers_take_turns_on_the_same_requests(bvv, monkeypatch):
    """Every server is measured at every level of every repeat, one after the other on the same
    seeded requests, the first one alternating between repeats; the CPU accounting of each run
    follows the server measured; the best repeat per server and level is reported."""
    args = bvv.parse_args(["--concurrency", "1", "4", "--repeats", "3", "--cores", "0"])
    runs, sessions = [], []
    # each server's throughput, run by run: (repeat 0: level 1, level 4), (repeat 1: ...), ...
    speed = {"http://a:1": [10.0, 30.0, 20.0, 5.0, 15.0, 25.0], "http://v:2": [40.0, 10.0, 15.0, 6.0, 50.0, 7.0]}

    def fake_bench(argv):
        ns = bench_serving.parse_args(argv)
        runs.append((ns.base_url, ns.max_concurrency, ns.seed))
        tok_s = speed[ns.base_url].pop(0) if ns.random_output_len == args.output_len else 0.0
        metrics = dict.fromkeys(("median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "median_e2e_latency_ms"), 1.0)
        return {
            **metrics,
            "completed": ns.num_prompts,
            "failed": 0,
            "output_throughput": tok_s,
            "duration": 1.0,
            "total_output_tokens": 1,
            "errors": [],
        }

    monkeypatch.setattr(levels, "_bench", fake_bench)
    monkeypatch.setattr(levels, "cpu_sample", lambda cores, session: sessions.append(session))
    monkeypatch.setattr(levels, "other_work_share", lambda before, after, n: 0.0)
    monkeypatch.setattr(levels, "settle", lambda cores: runs.append("settle"))
    points = levels.run_levels({"afd": ("http://a:1", 11), "vllm": ("http://v:2", 22)}, args)

    warm = [(r[0], r[1]) for r in runs[:2]]
    assert warm == [("http://a:1", 4), ("http://v:2", 4)]  # one untimed warm-up each, at the top level
    assert runs[2::2] == ["settle"] * 12  # every timed run waits for quiet cores first
    timed = runs[3::2]
    order = ["http://a:1", "http://v:2"] * 2 + ["http://v:2", "http://a:1"] * 2 + ["http://a:1", "http://v:2"] * 2
    assert [url for url, _, _ in timed] == order
    assert [conc for _, conc, _ in timed] == [1, 1, 4, 4] * 3
    for i in range(0, len(timed), 2):  # both servers of a turn get the same requests
        assert timed[i][1:] == timed[i + 1][1:]
    assert len({seed for _, _, seed in timed}) == 6
    assert sessions == [s for url, _, _ in timed for s in [11 if url == "http://a:1" else 22] * 2]
    assert [p["samples_tok_s"] for p in points["afd"]] == [[10.0, 20.0, 15.0], [30.0, 5.0, 25.0]]
    assert [p["output_tok_s"] for p in points["afd"]] == [20.0, 30.0]
    assert [p["output_tok_s"] for p in points["vllm"]] == [50.0, 10.0]


def test_both_servers_are_up_for_the_load_and_stopped_after_it(bvv, monkeypatch, tmp_path):
    """Both servers start before any load runs; one that failed to start is left out; every
    started server is stopped, also when the load fails."""
    events = []

    class FakeServer:
        def __init__(self, pid):
            self.pid = pid

        def stop(self):
            events.append(("stop", self.pid))

    def start(engine, model, args, log_dir):
        events.append(("start", engine))
        if engine == "vllm":
            return {"ok": False, "error": "no"}, None
        return {"ok": False, "base_url": f"http://{engine}"}, FakeServer(7)

    def levels_ok(servers, args):
        events.append(("load", sorted(servers.items())))
        return {name: [{"failed": 0, "other_work_share": 0.0}] for name in servers}

    monkeypatch.setattr(bvv, "start_engine", start)
    monkeypatch.setattr(bvv, "run_levels", levels_ok)
    args = bvv.parse_args([])
    records = bvv.run_engines(tmp_path, args, tmp_path)
    assert events == [("start", "afd"), ("start", "vllm"), ("load", [("afd", ("http://afd", 7))]), ("stop", 7)]
    assert records["afd"]["ok"] and not records["vllm"]["ok"]

    def levels_fail(servers, args):
        raise RuntimeError("bench failed")

    events.clear()
    monkeypatch.setattr(bvv, "run_levels", levels_fail)
    records = bvv.run_engines(tmp_path, args, tmp_path)
    assert events[-1] == ("stop", 7) and records["afd"]["error"] == "RuntimeError: bench failed"


def test_a_run_waits_for_quiet_cores_but_not_forever(monkeypatch):
    shares = [0.3, 0.1, 0.01, 0.0]
    monkeypatch.setattr(levels, "idle_check", lambda cores, seconds: shares.pop(0))
    levels.settle([0])
    assert shares == [0.0]  # returned at the first share under QUIET_SHARE
    calls = []
    monkeypatch.setattr(levels, "idle_check", lambda cores, seconds: calls.append(seconds) or 0.5)
    levels.settle([0])
    assert len(calls) == levels.QUIET_MAX_S / levels.QUIET_SAMPLE_S and set(calls) == {levels.QUIET_SAMPLE_S}
    monkeypatch.setattr(levels, "idle_check", lambda cores, seconds: None)  # no /proc: nothing to wait for
    levels.settle([0])
