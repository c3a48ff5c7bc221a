"""The throughput-vs-TPOT frontier: the best deployment of each mode at each SLO, as a PNG."""

from __future__ import annotations

from afd_engine.errors import ConfigError
from afd_engine.planner.search import SearchSpace, frontier
from afd_engine.planner.stages import StageModel

SLOS_MS = [float(s) for s in range(20, 201, 10)]


def plot_frontier(sm: StageModel, spaces: dict[str, SearchSpace], png: str, slo_ms: float | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None
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
