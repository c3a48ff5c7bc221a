"""Deployment SPEC strings (`--deployment`) and the simulated clusters they describe."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from afd_engine.errors import ConfigError
from afd_engine.planner.calibration import Calibration
from afd_engine.planner.deploy import MEMORY_RESERVE, Deployment, memory_gb
from afd_engine.planner.hardware import Hardware
from afd_engine.planner.model_spec import ModelSpec
from afd_engine.planner.sim.cluster import POLICIES, ClusterConfig, InstanceConfig, KVLink
from afd_engine.planner.sim.speculative import SpecDecoding
from afd_engine.planner.sim.step_time import StageStepTime
from afd_engine.planner.stages import StageModel
from afd_engine.planner.step_calibration import FittedStepTime, StepCalibration

SPEC_HELP = """\
A deployment SPEC is KIND:KEY=VALUE,... (quote it in a shell: pd's brackets are glob characters).
  colocated:gpus=N           N GPUs, each a DP attention rank holding 1/N of the experts (EP N)
  afd:a=A,f=F                A attention GPUs (DP A) + F expert GPUs (EP F)
  pd:prefill=[SPEC],decode=[SPEC]   PD disaggregation: prefill instances send KV to decode instances
Keys of colocated and afd (defaults in brackets):
  hw=NAME [H800]   ahw=, fhw= (afd: attention / expert GPUs [hw])   mb=MICRO_BATCHES [1; afd 2]
  replicas=R [1]: R such instances   shared=attention|ffn (afd) [attention]   dispatch=two-stage|direct (afd)
  tokens= (--max-num-batched-tokens)   running= (--max-running-requests)   pages= (--kv-pages)
  policy=lpm|fcfs (--schedule-policy)   imb= (--expert-imbalance)
Examples: colocated:gpus=64   afd:a=48,f=16,mb=3   'pd:prefill=[colocated:gpus=16],decode=[afd:a=32,f=16,mb=2]'"""

_KEYS = {
    "colocated": {"gpus", "hw", "mb", "replicas", "tokens", "running", "pages", "policy", "imb"},
    "afd": {"a", "f", "hw", "ahw", "fhw", "mb", "replicas", "shared", "dispatch", "tokens", "running", "pages"}
    | {"policy", "imb"},
    "pd": {"prefill", "decode"},
}
_REQUIRED = {"colocated": ("gpus",), "afd": ("a", "f"), "pd": ("prefill", "decode")}
_INT_KEYS = {"gpus", "a", "f", "mb", "replicas", "tokens", "running", "pages"}


@dataclass(frozen=True)
class DeploymentSpec:
    """A parsed SPEC: its kind, its options, and for pd the two inner SPECs."""

    text: str
    kind: str
    opts: dict
    prefill: DeploymentSpec | None = None
    decode: DeploymentSpec | None = None

    @property
    def gpus(self) -> int:
        if self.kind == "pd":
            return self.prefill.gpus + self.decode.gpus
        per = self.opts["gpus"] if self.kind == "colocated" else self.opts["a"] + self.opts["f"]
        return per * self.opts.get("replicas", 1)


def _split_top(text: str, where: str) -> list[str]:
    """Splits at commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"{where}: a ']' without its '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ConfigError(f"{where}: a '[' without its ']'")
    parts.append("".join(cur))
    return parts


def parse_spec(text: str, nested: bool = False) -> DeploymentSpec:
    """Parses a deployment SPEC (SPEC_HELP); raises ConfigError naming what is wrong."""
    where = f"--deployment {text!r}"
    kind, sep, rest = text.strip().partition(":")
    if kind not in _KEYS:
        raise ConfigError(f"{where}: kind {kind!r} must be colocated, afd or pd (e.g. colocated:gpus=64)")
    if nested and kind == "pd":
        raise ConfigError(f"{where}: pd cannot be nested inside pd")
    if not sep or not rest.strip():
        raise ConfigError(f"{where}: give KEY=VALUE options after '{kind}:' (needs {', '.join(_REQUIRED[kind])})")
    opts: dict = {}
    for part in _split_top(rest, where):
        key, eq, value = part.strip().partition("=")
        if not eq or not key or not value:
            raise ConfigError(f"{where}: {part!r} is not KEY=VALUE")
        if key not in _KEYS[kind]:
            raise ConfigError(f"{where}: unknown key {key!r} for {kind}; known: {', '.join(sorted(_KEYS[kind]))}")
        if key in opts:
            raise ConfigError(f"{where}: key {key!r} given twice")
        if key in _INT_KEYS:
            try:
                opts[key] = int(value)
            except ValueError:
                raise ConfigError(f"{where}: {key}={value!r} must be an integer") from None
            if opts[key] < 1:
                raise ConfigError(f"{where}: {key}={value} must be >= 1")
        elif key == "imb":
            try:
                opts[key] = float(value)
            except ValueError:
                raise ConfigError(f"{where}: imb={value!r} must be a number >= 1.0") from None
        elif key in ("prefill", "decode"):
            if not (value.startswith("[") and value.endswith("]")):
                raise ConfigError(f"{where}: {key}= takes a bracketed SPEC, e.g. {key}=[colocated:gpus=16]")
            opts[key] = parse_spec(value[1:-1], nested=True)
        else:
            opts[key] = value
    missing = [k for k in _REQUIRED[kind] if k not in opts]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    if opts.get("shared", "attention") not in ("attention", "ffn"):
        raise ConfigError(f"{where}: shared={opts['shared']!r} must be attention or ffn")
    if opts.get("dispatch", "two-stage") not in ("two-stage", "direct"):
        raise ConfigError(f"{where}: dispatch={opts['dispatch']!r} must be two-stage or direct")
    if opts.get("policy", "lpm") not in POLICIES:
        raise ConfigError(f"{where}: policy={opts['policy']!r} must be lpm or fcfs")
    if kind == "pd":
        return DeploymentSpec(text, kind, {}, opts["prefill"], opts["decode"])
    return DeploymentSpec(text, kind, opts)


@dataclass(frozen=True)
class BuildOptions:
    """What every instance shares unless its SPEC says otherwise."""

    model: ModelSpec
    hw: Callable[[str], Hardware]  # a hardware name -> its entry (catalog or --hw-file)
    attn_dtype: str
    weight_dtype: str = "fp8"
    calibration: Calibration | None = None
    step_calibration: StepCalibration | None = None  # replaces the stage model with a fit of this engine's steps
    expert_imbalance: float = 1.0
    index_dtype: str = "fp8"  # sparse attention: the indexer's keys in the KV cache and its score math
    page_tokens: int = 16
    max_batch_tokens: int = 2048
    max_running: int = 256
    policy: str = "lpm"
    kv_pages: int | None = None
    prefix_cache: bool = True
    router: str = "cache_aware"
    speculative: SpecDecoding | None = None  # of the instances that decode (not PD's prefill ones)


def _instance(spec: DeploymentSpec, b: BuildOptions, decodes: bool = True) -> tuple[InstanceConfig, Hardware, float]:
    """An instance from a colocated or afd SPEC, with its KV pages from the memory left after the
    weights (deploy.memory_gb's accounting); also its attention hardware and KV bytes per token.
    `decodes`: it runs decodes (all but PD's prefill instances), with `b.speculative` if set."""
    o = spec.opts
    afd = spec.kind == "afd"
    attn_hw = b.hw(o.get("ahw", o.get("hw", "H800")))
    ffn_hw = b.hw(o.get("fhw", o.get("hw", "H800"))) if afd else attn_hw
    sm = StageModel(
        b.model,
        attn_hw,
        ffn_hw,
        4096,  # (the per-position costs used here do not depend on it)
        b.attn_dtype,
        b.calibration,
        b.weight_dtype,
        expert_imbalance=o.get("imb", b.expert_imbalance),
        index_dtype=b.index_dtype,
    )
    mb = o.get("mb", 2 if afd else 1)
    ranks = o["a"] if afd else o["gpus"]
    ffn = o["f"] if afd else 0
    shared = o.get("shared", "attention")
    dispatch = o.get("dispatch", "two-stage")
    tokens = o.get("tokens", b.max_batch_tokens)
    dep = Deployment(spec.kind, ranks, ffn, mb, 0, dispatch, shared)
    dep.validate()
    if ffn > b.model.experts or (not afd and ranks > b.model.experts):
        raise ConfigError(f"--deployment {spec.text!r}: EP size above the model's {b.model.experts} experts")
    attn_gb, ffn_gb = memory_gb(sm, dep)
    if afd and ffn_gb > ffn_hw.mem_gb * (1 - MEMORY_RESERVE):
        raise ConfigError(
            f"--deployment {spec.text!r}: the experts need {ffn_gb:.0f} GB per FFN GPU, more than "
            f"{ffn_hw.name}'s {ffn_hw.mem_gb:g} GB less {MEMORY_RESERVE:.0%}; use more FFN GPUs"
        )
    kv_per_token = sm.kv_bytes_per_token()
    pages = o.get("pages", b.kv_pages)
    if pages is None:
        room = (attn_hw.mem_gb * (1 - MEMORY_RESERVE) - attn_gb) * 1e9
        pages = int(room // (kv_per_token * b.page_tokens))
        if pages < 1:
            raise ConfigError(
                f"--deployment {spec.text!r}: the weights need {attn_gb:.0f} GB per attention GPU, more than "
                f"{attn_hw.name}'s {attn_hw.mem_gb:g} GB less {MEMORY_RESERVE:.0%}; use more GPUs"
            )
    step = StageStepTime(sm, spec.kind, ranks, ffn, mb, dispatch, shared, tokens)
    if b.step_calibration is not None:
        step = FittedStepTime(b.step_calibration, step.roles)
    cfg = InstanceConfig(
        ranks=ranks,
        step_time=step,
        kv_pages=pages,
        gpus=ranks + ffn,
        replicas=o.get("replicas", 1),
        page_tokens=b.page_tokens,
        max_batch_tokens=tokens,
        max_running=o.get("running", b.max_running),
        policy=o.get("policy", b.policy),
        prefix_cache=b.prefix_cache,
        attention_topk=b.model.attention.index_topk,
        speculative=b.speculative if decodes else None,
    )
    cfg.validate(f"--deployment {spec.text!r}")
    return cfg, attn_hw, kv_per_token


def build_cluster(spec: DeploymentSpec, b: BuildOptions) -> ClusterConfig:
    """The simulated deployment of a SPEC, on the model and hardware of `b`."""
    if spec.kind != "pd":
        cfg, _, _ = _instance(spec, b)
        return ClusterConfig(spec.text, cfg, router=b.router)
    pre, pre_hw, kv_per_token = _instance(spec.prefill, b, decodes=False)
    dec, dec_hw, _ = _instance(spec.decode, b)
    return ClusterConfig(spec.text, pre, dec, KVLink.between(pre_hw, dec_hw, kv_per_token), b.router)
