"""Accelerators the planner knows: peak compute, memory, links, and how much of each a real decode
step gets (efficiency factors). More come from a YAML file (`--hw-file`).

Peaks are dense (no sparsity) vendor figures; for the accelerators of Step-3's table (H800, H20,
A800, 910B) tests/planner/test_published_figures.py holds their rooflines to that table.
Efficiency factors are one set per hardware type, shared by every model and deployment mode;
`planner/README` says where the H800 set comes from (two published deployments) and that the other
types inherit it until someone measures them (`afd plan calibrate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from afd_engine.errors import ConfigError


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak that decode kernels reach, and fixed costs the roofline does not see."""

    gemm_compute: float = 0.60  # grouped/dense fp8 GEMMs at decode shapes (DeepGEMM-class kernels)
    gemm_memory: float = 0.70  # weight streaming when a GEMM is memory-bound (small batches)
    attn_compute: float = 0.45  # decode attention core when compute-bound (MLA absorbed)
    attn_memory: float = 0.70  # decode attention core when KV-bandwidth-bound
    nic: float = 0.80  # RDMA goodput / line rate (Baidu's and DeepEP's figure)
    scaleup: float = 0.80  # NVLink-class goodput / line rate
    comm_latency_us: float = 20.0  # fixed cost of one dispatch or combine (issue, sync, completion)
    layer_overhead_us: float = 50.0  # per layer and micro-batch: norms, rope, quantization, launches
    step_overhead_us: float = 1500.0  # per decode step: sampling, scheduling, host-device sync

    def validate(self, where: str) -> None:
        for name in ("gemm_compute", "gemm_memory", "attn_compute", "attn_memory", "nic", "scaleup"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"{where}: efficiency {name}={value} must be in (0, 1]")
        for name in ("comm_latency_us", "layer_overhead_us", "step_overhead_us"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}: efficiency {name} must be >= 0")


@dataclass(frozen=True)
class Hardware:
    """One accelerator type and the node it sits in. Bandwidths are per direction."""

    name: str
    bf16_tflops: float
    fp8_tflops: float | None  # None: no fp8 tensor cores (weights stay 8-bit, math runs in bf16)
    mem_bw_tbs: float  # HBM, TB/s
    mem_gb: float
    scaleup_gbs: float  # per GPU and direction inside a node (NVLink, HCCS, PCIe), GB/s
    nic_gbps: float  # one NIC's line rate, Gb/s
    nics_per_node: int = 8
    gpus_per_node: int = 8
    efficiency: Efficiency = field(default_factory=Efficiency)
    note: str = ""

    def tflops(self, dtype: str) -> float:
        """Peak for GEMMs whose operands are `dtype` (fp8 falls back to bf16 math without fp8 units)."""
        if dtype == "fp8" and self.fp8_tflops:
            return self.fp8_tflops
        return self.bf16_tflops

    @property
    def roofline(self) -> float:
        """FLOPs per byte of HBM traffic at which 8-bit GEMMs turn compute-bound (Step-3's Table 4)."""
        return self.tflops("fp8") / self.mem_bw_tbs

    @property
    def nic_gbs_per_gpu(self) -> float:
        """Line rate of the scale-out network per GPU, GB/s."""
        return self.nic_gbps * self.nics_per_node / self.gpus_per_node / 8

    @property
    def node_nic_gbps(self) -> float:
        return self.nic_gbps * self.nics_per_node

    def validate(self) -> None:
        for name in ("bf16_tflops", "mem_bw_tbs", "mem_gb", "scaleup_gbs", "nic_gbps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"hardware {self.name}: {name} must be > 0")
        if self.nics_per_node < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"hardware {self.name}: nics_per_node and gpus_per_node must be >= 1")
        self.efficiency.validate(f"hardware {self.name}")


# H800 factors were fitted once to two published deployments (Step-3 2A2F and DeepSeek-V3's EP
# profile, see planner/README); every other type inherits them: unmeasured, not tuned.
_HOPPER = Efficiency()

HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "H800",
            989,
            1979,
            3.35,
            80,
            scaleup_gbs=200,
            nic_gbps=400,
            efficiency=_HOPPER,
            note="NVLink 400 GB/s bidirectional; CX7 400 Gb/s per GPU",
        ),
        Hardware(
            "H100",
            989,
            1979,
            3.35,
            80,
            scaleup_gbs=450,
            nic_gbps=400,
            efficiency=_HOPPER,
            note="SXM; NVLink 900 GB/s bidirectional",
        ),
        Hardware(
            "H200",
            989,
            1979,
            4.8,
            141,
            scaleup_gbs=450,
            nic_gbps=400,
            efficiency=_HOPPER,
            note="H100 compute with 4.8 TB/s HBM3e",
        ),
        Hardware(
            "H20",
            148,
            296,
            4.0,
            96,
            scaleup_gbs=450,
            nic_gbps=400,
            efficiency=_HOPPER,
            note="Step-3 Table 4: roofline 74",
        ),
        Hardware(
            "A800",
            312,
            None,
            2.0,
            80,
            scaleup_gbs=200,
            nic_gbps=200,
            efficiency=_HOPPER,
            note="no fp8: 8-bit weights, bf16 math; 8 x 200 Gb/s",
        ),
        Hardware(
            "L20",
            119.5,
            239,
            0.864,
            48,
            scaleup_gbs=32,
            nic_gbps=200,
            efficiency=_HOPPER,
            note="PCIe Gen4 card: no NVLink; NIC count assumed 8 x 200 Gb/s",
        ),
        Hardware(
            "910B",
            280,
            None,
            1.6,
            64,
            scaleup_gbs=196,
            nic_gbps=200,
            efficiency=_HOPPER,
            note="Ascend 910B: HCCS scale-up; 8 x 200 Gb/s as in Step-3's table",
        ),
    )
}


def get_hardware(name: str, extra: dict[str, Hardware] | None = None) -> Hardware:
    catalog = {**HARDWARE, **(extra or {})}
    for key, hw in catalog.items():
        if key.lower() == name.lower():
            return hw
    raise ConfigError(f"unknown hardware {name!r}; known: {', '.join(catalog)} (or add it with --hw-file)")


def load_hardware_file(path: str | Path) -> dict[str, Hardware]:
    """Hardware from YAML: a mapping of name -> fields of `Hardware` (`efficiency` a nested mapping;
    `base: H800` starts from a catalog entry and overrides only what is given)."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--hw-file {path}: no such file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--hw-file {path}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--hw-file {path}: expected a mapping of hardware name -> fields")
    return {name: _hardware_from_dict(str(name), fields or {}, path) for name, fields in raw.items()}


def _hardware_from_dict(name: str, fields: dict, path) -> Hardware:
    fields = dict(fields)
    base_name = fields.pop("base", None)
    eff_fields = fields.pop("efficiency", {}) or {}
    try:
        if base_name is not None:
            base = get_hardware(str(base_name))
            hw = replace(base, name=name, efficiency=replace(base.efficiency, **eff_fields), **fields)
        else:
            hw = Hardware(name=name, efficiency=Efficiency(**eff_fields), **fields)
    except TypeError as exc:
        raise ConfigError(f"--hw-file {path}: hardware {name}: {exc}") from None
    hw.validate()
    return hw
