"""The planner's plots, one PNG each: the throughput-vs-TPOT frontier of `afd plan deploy` and the
SLO attainment of `afd plan simulate` against the request rate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from afd_engine.errors import ConfigError
from afd_engine.planner.search import SearchSpace, frontier
from afd_engine.planner.stages import StageModel

if TYPE_CHECKING:
    from afd_engine.planner.sim.results import SLO

SLOS_MS = [float(s) for s in range(20, 201, 10)]


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display), or a ConfigError naming the
    missing package: plotting is optional."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None
    return plt


def plot_frontier(sm: StageModel, spaces: dict[str, SearchSpace], png: str, slo_ms: float | None = None) -> None:
    """Tokens per GPU per second against TPOT: each mode's best deployment at each SLO."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, space in spaces.items():
        points = frontier(sm, mode, SLOS_MS, space)
        ax.plot([e.tpot_ms for e in points], [e.tokens_per_gpu_s for e in points], marker="o", markersize=3, label=mode)
    if slo_ms:
        ax.axvline(slo_ms, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo_ms:g} ms")
    ax.set_xlabel("TPOT (ms)")
    ax.set_ylabel("tokens / GPU / s")
    ffn = f" + {sm.ffn_hw.name} (F)" if sm.ffn_hw is not sm.attn_hw else ""
    skew = f", expert imbalance {sm.expert_imbalance:g}" if sm.expert_imbalance != 1.0 else ""
    ax.set_title(f"{sm.model.name}, {sm.attn_hw.name}{ffn}, context {sm.context}, attention {sm.attn_dtype}{skew}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def plot_attainment(sweep: dict[str, list[dict]], gpus: dict[str, int], slo: SLO, png: str, title: str) -> None:
    """SLO attainment (left) and goodput per GPU (right) against the request rate, one line per
    deployment of the sweep."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, points in sweep.items():
        x = [p["request_rate_rps"] for p in points]
        label = f"{name} ({gpus[name]} GPUs)"
        left.plot(x, [100 * p["attainment"] for p in points], marker="o", markersize=3, label=label)
        right.plot(x, [p["goodput_rps_per_gpu"] for p in points], marker="o", markersize=3, label=label)
    left.set_ylabel(f"SLO attainment (%): TTFT <= {slo.ttft_s * 1e3:g} ms, TPOT <= {slo.tpot_s * 1e3:g} ms")
    left.set_ylim(-2, 102)
    right.set_ylabel("goodput (requests / s / GPU)")
    for ax in (left, right):
        ax.set_xlabel("request rate (requests / s)")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
