"""The decode batch sizes CUDA graphs are captured for (--cuda-graph-bs, --cuda-graph-max-bs).

Pure settings arithmetic: `engine_args` validates the flags with it and `runtime/cuda_graph.py`
captures one graph per size, so the settings layer never imports the runtime.
"""

from __future__ import annotations

DEFAULT_MAX_BS = 64


def graph_buckets(max_bs: int) -> list[int]:
    """The default captured batch sizes, ascending: 1, 2, 4, 8, then every 8 up to `max_bs` (which
    is always one)."""
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8))
    return sorted({*sizes, max_bs})


def bucket_for(buckets: list[int], rows: int) -> int | None:
    """The smallest of `buckets` (ascending) holding `rows`; None above the largest."""
    return next((bs for bs in buckets if bs >= rows), None)


def ffn_graph_buckets(max_rows: int) -> list[int]:
    """The default received-token counts of FFN expert graphs: 8, 16, 32, ... up to the first power
    of two holding `max_rows`."""
    sizes = [8]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] * 2)
    return sizes


def parse_buckets(text: str) -> list[int]:
    """--cuda-graph-bs as ints; ValueError naming what is wrong."""
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of batch sizes") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{text!r}: give positive batch sizes, e.g. 1,2,4,8")
    return sorted(set(sizes))
