"""EngineArgs: every engine setting and its default, in one place, for the CLI and Python alike.

`Engine(model_path=..., kv_cache_memory_mb=...)` and `afd ... --model-path ... --kv-cache-memory-mb`
are the same setting: each field becomes a flag with underscores turned into dashes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields

import torch

from afd_engine.errors import ConfigError
from afd_engine.graph_sizes import DEFAULT_MAX_BS, ffn_graph_buckets, graph_buckets, parse_buckets
from kernels.registry import ATTENTION_BACKENDS, MOE_BACKENDS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
AUTO_SPIN_US = 2000  # --comm-spin-us where every rank has cores of its own (bench_latency.py)


def opt(default, help: str, **extra):
    """A settings field: its default, its --flag's help, and argparse extras (choices)."""
    return field(default=default, metadata={"help": help, **extra})


def add_flags(settings_cls, parser: argparse.ArgumentParser) -> None:
    """One --flag per field of a settings dataclass made with `opt` (underscores become dashes)."""
    for f in fields(settings_cls):
        if f.type == "bool":  # (`flags`: its spellings, where it has several)
            names = f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)
            parser.add_argument(*names, dest=f.name, action="store_true", help=f.metadata["help"])
            continue
        if "list[str]" in f.type:  # the flag may be given several times
            parser.add_argument("--" + f.name.replace("_", "-"), action="append", default=None, help=f.metadata["help"])
            continue
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=_flag_type(f.type),
            default=f.default,
            help=f.metadata["help"],
            choices=f.metadata.get("choices"),
        )


# a settings field's type -> (whether a value is of it, how an error names it); bool is no number here
_TYPES = {
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list[str]": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v), "a list of strings"),
}


def setting_error(settings_cls, name: str, value) -> str | None:
    """Why `value` cannot be field `name` of a settings dataclass made with `opt` (its type or its
    choices), or None. The command line, the Python API and YAML files share this check."""
    f = next(f for f in fields(settings_cls) if f.name == name)
    kinds = [k.strip() for k in f.type.split("|")]
    if value is None:
        return None if "None" in kinds else "must be given (it has no empty value)"
    checks = [_TYPES[k] for k in kinds if k != "None"]
    if not any(accepts(value) for accepts, _ in checks):
        return "must be " + " or ".join(what for _, what in checks)
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        return f"choose one of {', '.join(choices)}"
    return None


def check_fields(settings) -> None:
    """Every field of a settings object against its type and choices; a ConfigError naming the flag."""
    for f in fields(settings):
        value = getattr(settings, f.name)
        error = setting_error(type(settings), f.name, value)
        if error:
            raise ConfigError(f"--{f.name.replace('_', '-')}={value!r}: {error}")


@dataclass(frozen=True)
class EngineArgs:
    model_path: str | None = opt(None, "Hugging Face checkpoint directory (default: the embedded tiny model)")
    dtype: str = opt(
        "auto",
        "weights and activations: float32, bfloat16 or auto (float32 on CPU)",
        choices=("auto", "float32", "bfloat16"),
    )
    kv_cache_memory_mb: float = opt(256.0, "memory budget of the paged KV cache, in MiB")
    max_total_tokens: int | None = opt(None, "KV cache size in tokens; overrides --kv-cache-memory-mb")
    page_size: int = opt(16, "tokens per KV cache page")
    max_num_batched_tokens: int = opt(2048, "token budget of one step; longer prompts are prefilled in chunks")
    max_running_requests: int = opt(256, "most requests in the running batch at once")
    context_length: int | None = opt(None, "longest prompt + output (default: the model's max_position_embeddings)")
    num_threads: int | None = opt(
        None, "torch threads per process (default: the usable cores, shared evenly by the ranks on this machine)"
    )
    pin_cores: bool = opt(
        False,
        "pin each rank process on this machine to its own cores: the usable cores split evenly, in order "
        "(no pinning when there are more ranks than cores); the front end is not pinned",
    )
    seed: int = opt(0, "seed for requests that do not set their own")
    disable_radix_cache: bool = opt(
        False, "do not reuse cached prompt prefixes (every prompt is prefilled in full; freed pages go back at once)"
    )
    overlap_schedule: str = opt(
        "auto",
        "prepare step n+1, and check and send step n's tokens, while step n's forward runs: on, off, or auto "
        "(on where the forward runs on a GPU; off on a CPU, where the forward needs every core and a step "
        "measured slower with overlap: see benchmarks/bench_overhead.py)",
        choices=("auto", "on", "off"),
    )
    disable_overlap_schedule: bool = opt(False, "the same as --overlap-schedule off")
    cuda_graph_max_bs: int | None = opt(
        None,
        "cuda: the largest decode batch (micro-batch, on attention ranks) replayed from a CUDA graph (default: "
        "--max-running-requests, "
        "at most 64); larger decode steps and steps with prefill run eagerly",
    )
    cuda_graph_bs: str | None = opt(
        None, "cuda: the decode batch sizes captured, comma-separated (default: 1, 2, 4, 8, then every 8 up to the max)"
    )
    disable_cuda_graph: bool = opt(False, "cuda: run every decode step eagerly (no CUDA graphs)")
    host_payloads: bool = opt(
        False,
        "cuda: tensors between the ranks of one machine cross through host shared memory (a copy to the host "
        "and back per message) instead of GPU memory shared between the rank processes",
    )
    static_decode: bool = opt(
        False,
        "run every decode step of every role through the padded, persistent-buffer path CUDA graphs replay, "
        "without capturing (the CPU stand-in for graphs; on by itself wherever graphs are captured)",
    )
    ffn_cuda_graph_bs: str | None = opt(
        None,
        "cuda, FFN and colocated ranks: the received-token counts their expert graphs are captured for, "
        "comma-separated (default: 8, 16, 32, ... up to the largest decode graph's batch x --dp-size: a token "
        "reaches an FFN rank at most once)",
    )
    ffn_weight_dtype: str = opt(
        "auto",
        "precision of the routed experts where they are held (FFN ranks in AFD, every rank elsewhere): auto "
        "(the checkpoint's), bf16, or fp8 (block-quantized, 128x128 blocks) while attention keeps --dtype",
        choices=("auto", "bf16", "fp8"),
    )
    index_cache_dtype: str = opt(
        "auto",
        "DeepSeek-V3.2's indexer keys in the KV cache: auto (the cache's dtype) or fp8 (e4m3 bytes and one fp32 "
        "scale per token, as the reference stores them: 132 bytes a token and layer at index_head_dim 128, "
        "against 256 in bf16)",
        choices=("auto", "fp8"),
    )
    schedule_policy: str = opt(
        "lpm",
        "admission order of waiting requests: lpm (longest cached prefix first, oldest first once they have "
        "waited long) or fcfs (arrival order)",
        choices=("lpm", "fcfs"),
    )
    load_balance_method: str = opt(
        "cache_aware",
        "which attention rank takes a request: cache_aware (the rank that has seen its longest prefix, "
        "unless that rank is much busier), shortest_queue or round_robin",
        choices=("cache_aware", "shortest_queue", "round_robin"),
    )
    device: str = opt(
        "auto",
        "where weights, KV cache and activations live: cpu, cuda, or auto (cuda when a GPU is present)",
        choices=("auto", "cpu", "cuda"),
    )
    base_gpu_id: int = opt(0, "cuda: the first GPU; rank i of a deployment takes GPU base + i x step")
    gpu_id_step: int = opt(
        1,
        "cuda: GPUs between consecutive ranks of this machine (0: every rank on the base GPU, e.g. 1A+1F on one)",
    )
    attention_backend: str = opt(
        "cpu",
        "attention kernels of attention ranks, by name (kernels/registry.py); cpu: the torch reference with "
        "a C decode attention kernel (MLA and GQA) for fp32 CPU tensors",
    )
    moe_backend: str = opt(
        "cpu",
        "routed-expert kernels of the ranks that hold experts, by name (kernels/registry.py); cpu: the torch "
        "reference with a C kernel for decode-sized fp32 CPU batches",
    )
    mode: str = opt(
        "single",
        "single (one process), colocated (DP attention + EP on the same ranks) or afd "
        "(attention and routed experts on separate ranks)",
        choices=("single", "colocated", "afd"),
    )
    dp_size: int = opt(
        1, "attention (data-parallel) ranks; with --mode single, independent replicas of the whole model"
    )
    ffn_nodes: int = opt(1, "afd: FFN nodes (machines of FFN ranks)")
    ffn_ranks_per_node: int = opt(1, "afd: FFN ranks per FFN node")
    ep_size: int | None = opt(
        None, "expert-parallel ranks, as a check (afd: ffn-nodes x ffn-ranks-per-node; colocated: dp-size)"
    )
    micro_batches: int | None = opt(None, "micro-batches in flight per step (default: 3 for afd, 1 otherwise)")
    dispatch: str | None = opt(
        None, "two-stage or direct (default: two-stage for afd; colocated is direct)", choices=("two-stage", "direct")
    )
    dispatch_dtype: str = opt(
        "auto",
        "dispatch wire format: auto (the activations' dtype), fp32, bf16 or fp8",
        choices=("auto", "fp32", "bf16", "fp8"),
    )
    combine_dtype: str = opt(
        "auto", "combine wire format: auto (the activations' dtype), fp32 or bf16", choices=("auto", "fp32", "bf16")
    )
    comm_timeout: float = opt(30.0, "seconds a rank waits for a peer before failing the step")
    comm_spin_us: int | None = opt(
        None,
        "shared-memory data plane: microseconds a waiting rank may keep looking for a message before it "
        "sleeps, while most of its recent waits were that short (0: always sleep at once; default: "
        f"{AUTO_SPIN_US} where this machine's ranks x threads fit its cores, else 0)",
    )
    comm_spin_priority: str = opt(
        "idle",
        "scheduling priority of a rank looking for a message (--comm-spin-us): idle (Linux SCHED_IDLE, so that "
        "any other work of the machine goes first; normal where the OS refuses it) or normal",
        choices=("idle", "normal"),
    )
    transport: str = opt(
        "auto",
        "data plane between ranks: auto (shared memory on one machine where /dev/shm has room for the rings, "
        "else ZeroMQ over TCP), shm (shared memory or an error), zmq (ranks on other machines use ZeroMQ with "
        "these three), or torch (torch.distributed point to point everywhere: NCCL between GPU ranks, so "
        "payloads never leave the device, gloo between CPU ranks)",
        choices=("auto", "shm", "zmq", "torch"),
    )
    ep_num_redundant_experts: int = opt(
        0,
        "colocated/afd: physical expert slots beyond one per expert, per MoE layer, holding copies of hot "
        "experts (experts + this must divide over the expert ranks)",
    )
    enable_eplb: bool = opt(False, "colocated/afd: rebalance expert placement from the measured load while serving")
    enable_ffn_fault_tolerance: bool = opt(
        False,
        "afd: keep serving when a rank dies. An FFN rank (exits, or sends no heartbeat for --comm-timeout): "
        "the attention ranks mask it, move its experts to the survivors (copies first, else read from the "
        "checkpoint into spare slots, or into slots the survivors grow within --ffn-expert-memory-mb) and run "
        "the interrupted step again. An attention rank (its process exits): the others and the FFN ranks go "
        "on without it, and its requests resume on them from the tokens streamed so far (default: the "
        "deployment fails fast; --enable-ffn-fault-tolerance is the same flag)",
        flags=("--enable-fault-tolerance", "--enable-ffn-fault-tolerance"),
    )
    ffn_recovery_timeout: float = opt(
        60.0, "with --enable-ffn-fault-tolerance: seconds serving may pause while survivors load a lost rank's experts"
    )
    ffn_expert_memory_mb: float | None = opt(
        None,
        "afd: the most memory an FFN rank's routed experts may take, in MiB, where a recovery gives a "
        "survivor more expert slots than it started with (default: on a GPU, what the device has free once "
        "the rank is loaded less a tenth of it, at least 2 GiB; on the CPU, twice the rank's starting expert "
        "bytes)",
    )
    eplb_rebalance_num_iterations: int = opt(1000, "with --enable-eplb: steps between rebalances")
    init_expert_location: str | None = opt(
        None,
        "colocated/afd: start from the placement that balances this load report (the JSON of GET /expert_load "
        "or afd expert-load --output; every machine needs the file)",
    )
    eplb_window_steps: int | None = opt(
        None, "steps of expert load statistics kept (default: --eplb-rebalance-num-iterations)"
    )
    record_timeline: str | None = opt(
        None, "write per-operation timing events of every rank to PATH.<role><rank>.jsonl"
    )
    record_steps: str | None = opt(
        None,
        "write one JSONL record per forward step (load and wall time; `afd plan simulate --step-calibration`) "
        "to PATH, or PATH.a<rank>.jsonl for each attention rank of a deployment; `afd serve` also writes "
        "when its API server handed each request to a rank to PATH.frontend.jsonl",
    )
    speculative_algorithm: str | None = opt(
        None,
        "speculative decoding: NEXTN drafts with the checkpoint's multi-token prediction (MTP) module and "
        "verifies the drafts in one forward (EAGLE: the same here)",
        choices=("NEXTN", "EAGLE"),
    )
    speculative_num_steps: int | None = opt(
        None, "with --speculative-algorithm: draft tokens per step, the MTP module chained (default 1)"
    )
    speculative_num_draft_tokens: int | None = opt(
        None, "with --speculative-algorithm: tokens a step verifies per request, --speculative-num-steps + 1"
    )
    speculative_eagle_topk: int | None = opt(
        None, "with --speculative-algorithm: drafts per step and position; 1 (a chain) is what is supported"
    )
    disaggregation_mode: str = opt(
        "null",
        "prefill-decode disaggregation: null (prefill and decode here), prefill (prompts only; the KV cache goes "
        "to a decode instance) or decode (takes prefilled KV caches; requests come through `afd router`)",
        choices=("null", "prefill", "decode"),
    )
    disaggregation_transfer_backend: str = opt(
        "builtin",
        "how KV pages move from prefill to decode: builtin (ZeroMQ messages) or mooncake (the Mooncake Transfer "
        "Engine writes into the decode instance's registered pool)",
        choices=("builtin", "mooncake"),
    )
    disaggregation_bootstrap_port: int = opt(
        8998, "prefill: the port where decode ranks learn this instance's ranks and model (the bootstrap server)"
    )
    disaggregation_host: str = opt(
        "127.0.0.1", "prefill/decode: the address this machine's ranks give peers for KV messages and transfers"
    )
    disaggregation_ib_device: str | None = opt(
        None, "mooncake: the RDMA device (e.g. mlx5_0); without it Mooncake moves pages over TCP"
    )
    disaggregation_timeout: float = opt(
        60.0, "prefill/decode: seconds a request may wait for its peer (reservation, pages) before it fails"
    )
    inject_attention_delay_ms: float = opt(0.0, "experiments: extra compute per MoE layer and micro-batch on A")
    inject_ffn_delay_ms: float = opt(0.0, "experiments: extra compute per MoE layer and micro-batch on F")
    inject_ffn_delay_us_per_token: float = opt(
        0.0, "experiments: extra compute per token copy an FFN rank receives, per MoE layer (a compute-bound rank)"
    )
    inject_link_delay_ms: float = opt(0.0, "experiments: latency added to every data-plane message")

    def validate(self) -> None:
        def need(ok: bool, flag: str, fix: str) -> None:
            if not ok:
                raise ConfigError(f"--{flag.replace('_', '-')}={getattr(self, flag)!r}: {fix}")

        check_fields(self)
        need(self.kv_cache_memory_mb > 0, "kv_cache_memory_mb", "must be positive")
        need(self.max_total_tokens is None or self.max_total_tokens >= 1, "max_total_tokens", "must be positive")
        need(self.page_size >= 1, "page_size", "must be at least 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be at least 1")
        need(self.max_running_requests >= 1, "max_running_requests", "must be at least 1")
        need(self.context_length is None or self.context_length >= 2, "context_length", "must be at least 2")
        need(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be at least 1")
        need(
            not (self.disable_overlap_schedule and self.overlap_schedule == "on"),
            "overlap_schedule",
            "contradicts --disable-overlap-schedule; give one of them",
        )
        need(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs", "must be at least 1")
        if self.cuda_graph_bs is not None:
            try:
                parse_buckets(self.cuda_graph_bs)
            except ValueError as exc:
                raise ConfigError(f"--cuda-graph-bs={self.cuda_graph_bs!r}: {exc}") from None
        if self.ffn_cuda_graph_bs is not None:
            try:
                parse_buckets(self.ffn_cuda_graph_bs)
            except ValueError as exc:
                raise ConfigError(f"--ffn-cuda-graph-bs={self.ffn_cuda_graph_bs!r}: {exc}") from None
        need(self.dp_size >= 1, "dp_size", "must be at least 1")
        need(self.ffn_nodes >= 1 and self.ffn_ranks_per_node >= 1, "ffn_nodes", "needs at least one node of one rank")
        need(self.micro_batches is None or 1 <= self.micro_batches <= 8, "micro_batches", "must be in [1, 8]")
        need(
            not (self.mode == "colocated" and self.dispatch == "two-stage"),
            "dispatch",
            "the colocated baseline dispatches directly; two-stage needs --mode afd",
        )
        need(self.comm_timeout > 0, "comm_timeout", "must be positive")
        spin_ok = self.comm_spin_us is None or 0 <= self.comm_spin_us <= 1_000_000
        need(spin_ok, "comm_spin_us", "must be between 0 and 1000000 (1 s)")
        need(
            not (self.transport == "torch" and self.inject_link_delay_ms),
            "inject_link_delay_ms",
            "the added link delay exists on the shm and zmq transports only, not with --transport torch",
        )
        need(self.ep_num_redundant_experts >= 0, "ep_num_redundant_experts", "must be >= 0")
        need(
            self.mode != "single"
            or (self.ep_num_redundant_experts == 0 and not self.enable_eplb and self.init_expert_location is None),
            "mode",
            "redundant experts, --enable-eplb and --init-expert-location balance expert ranks; "
            "use --mode colocated or afd",
        )
        need(
            not self.enable_ffn_fault_tolerance or self.mode in ("afd", "colocated"),
            "enable_ffn_fault_tolerance",
            "masks lost ranks of an AFD or colocated deployment; use --mode afd or colocated",
        )
        need(
            not (self.enable_ffn_fault_tolerance and self.transport == "torch"),
            "enable_ffn_fault_tolerance",
            "needs the shm or zmq data plane: a torch.distributed group cannot lose a member",
        )
        need(self.ffn_recovery_timeout > 0, "ffn_recovery_timeout", "must be positive")
        memory = self.ffn_expert_memory_mb
        need(memory is None or memory > 0, "ffn_expert_memory_mb", "must be positive")
        need(self.eplb_rebalance_num_iterations >= 1, "eplb_rebalance_num_iterations", "must be at least 1")
        need(self.eplb_window_steps is None or self.eplb_window_steps >= 1, "eplb_window_steps", "must be >= 1")
        need(self.disaggregation_timeout > 0, "disaggregation_timeout", "must be positive")
        need(0 < self.disaggregation_bootstrap_port < 65536, "disaggregation_bootstrap_port", "must be a TCP port")
        need(self.base_gpu_id >= 0, "base_gpu_id", "must be >= 0")
        need(self.gpu_id_step >= 0, "gpu_id_step", "must be >= 0")
        self._validate_speculation(need)
        need(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"unknown backend; known: {', '.join(sorted(ATTENTION_BACKENDS))}",
        )
        need(
            self.moe_backend in MOE_BACKENDS,
            "moe_backend",
            f"unknown backend; known: {', '.join(sorted(MOE_BACKENDS))}",
        )

    def _validate_speculation(self, need) -> None:
        given = [
            f
            for f in ("speculative_num_steps", "speculative_num_draft_tokens", "speculative_eagle_topk")
            if getattr(self, f) is not None
        ]
        if self.speculative_algorithm is None:
            for f in given:
                need(False, f, "needs --speculative-algorithm NEXTN")
            return
        steps = self.spec_steps
        named = "speculative_num_steps" if "speculative_num_steps" in given else "speculative_num_draft_tokens"
        need(1 <= steps <= 8, named, "draft steps must be between 1 and 8")
        need(
            self.speculative_num_draft_tokens is None or self.speculative_num_draft_tokens == steps + 1,
            "speculative_num_draft_tokens",
            f"with --speculative-num-steps={steps} and a chain of drafts it is {steps + 1} (tree drafts are not "
            "supported)",
        )
        need(
            self.speculative_eagle_topk in (None, 1),
            "speculative_eagle_topk",
            "only 1 is supported (a chain of drafts; tree drafts are not)",
        )
        refused = {
            "enable_eplb": self.enable_eplb,
            "init_expert_location": self.init_expert_location is not None,
            "enable_ffn_fault_tolerance": self.enable_ffn_fault_tolerance,
            "overlap_schedule": self.overlap_schedule == "on",
            "static_decode": self.static_decode,
            "record_steps": self.record_steps is not None,
        }
        for flag, clash in refused.items():
            need(
                not clash,
                flag,
                f"is not supported with --speculative-algorithm {self.speculative_algorithm} yet (speculative "
                "steps run without overlapped scheduling, graph buffers, expert rebalancing or fault tolerance)",
            )

    @property
    def spec_steps(self) -> int:
        """Draft steps per speculative step; 0 without speculative decoding."""
        if self.speculative_algorithm is None:
            return 0
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens - 1
        return 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES["float32" if self.dtype == "auto" else self.dtype]

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches or (3 if self.mode == "afd" else 1)

    @property
    def load_window_steps(self) -> int:
        return self.eplb_window_steps or self.eplb_rebalance_num_iterations

    @property
    def dispatch_mode(self) -> str:
        return self.dispatch or ("two-stage" if self.mode == "afd" else "direct")

    def device_for(self, rank: int = 0) -> torch.device:
        """The device of rank `rank` (a process index within this machine's deployment): cuda:(base
        + rank x step) on GPUs, else the CPU. Reads torch.cuda only when asked for (never at import)."""
        kind = self.device
        if kind == "auto":
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        if kind == "cpu":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ConfigError("--device=cuda but torch sees no CUDA GPU; use --device cpu")
        index = self.base_gpu_id + rank * self.gpu_id_step
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"rank {rank} needs GPU {index} (--base-gpu-id={self.base_gpu_id} + rank x --gpu-id-step="
                f"{self.gpu_id_step}) but only {torch.cuda.device_count()} GPUs are visible; lower --base-gpu-id, "
                "the rank count, or --gpu-id-step (0 puts every rank on one GPU)"
            )
        return torch.device("cuda", index)

    def graph_buckets(self) -> list[int]:
        """The decode batch sizes CUDA graphs are captured for (runtime/cuda_graph.py)."""
        if self.cuda_graph_bs:
            return parse_buckets(self.cuda_graph_bs)
        return graph_buckets(self.cuda_graph_max_bs or min(self.max_running_requests, DEFAULT_MAX_BS))

    def ffn_graph_buckets(self) -> list[int]:
        """The received-token counts FFN ranks' expert graphs are captured for (--ffn-cuda-graph-bs)."""
        if self.ffn_cuda_graph_bs:
            return parse_buckets(self.ffn_cuda_graph_bs)
        return ffn_graph_buckets(self.graph_buckets()[-1] * self.dp_size)

    def overlap_on(self, device: torch.device) -> bool:
        """Whether steps overlap (--overlap-schedule) for a rank on `device`."""
        if self.disable_overlap_schedule or self.overlap_schedule == "off":
            return False
        return self.overlap_schedule == "on" or device.type == "cuda"

    @property
    def threads(self) -> int:
        return self.num_threads or usable_cpus()

    def replace(self, **changes) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_flags(EngineArgs, parser)

    @staticmethod
    def from_cli(ns: argparse.Namespace) -> EngineArgs:
        return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)})

    @staticmethod
    def from_kwargs(**kwargs) -> EngineArgs:
        names = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine setting(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return EngineArgs(**kwargs)


def core_shares(cores: list[int], processes: int) -> list[list[int]] | None:
    """`processes` disjoint, equal, ordered shares of `cores` (the rest left over); None when there
    are more processes than cores."""
    if processes < 1 or processes > len(cores):
        return None
    k = len(cores) // processes
    return [cores[i * k : (i + 1) * k] for i in range(processes)]


def usable_core_ids() -> list[int]:
    """The cores this process may run on (a container's or taskset's limit, not the machine's);
    empty where the OS has no affinity API (then nothing can be pinned)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return []


def usable_cpus() -> int:
    """How many cores this process may run on."""
    return len(usable_core_ids()) or os.cpu_count() or 1


def _flag_type(annotation: str):
    return {"int": int, "float": float}.get(annotation.split(" |")[0], str)
