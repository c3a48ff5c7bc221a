"""Process names: each process of a deployment carries its role, so that `ps`, `top` and `pkill -f`
see which is which (SGLang and vLLM name theirs the same way):

    afd::api                 the HTTP front end of `afd serve` / `afd launch --role attention`
    afd::router              `afd router` (and the router of `afd serve --pd`)
    afd::engine              the engine process of single mode (afd::engine-<i>: replica i of --dp-size)
    afd::attention-<rank>    an attention rank (colocated and AFD)
    afd::ffn-<node>-<local>  FFN rank <local> of FFN node <node> (AFD)
    afd::forkserver          the process that rank processes fork from (processes/rank_process.py)
"""

from __future__ import annotations

import logging

log = logging.getLogger("afd")


def set_title(title: str) -> None:
    """Names this process `title`: its command line as `ps` shows it, and its kernel name (the
    first 15 characters, what `top` shows)."""
    try:
        import setproctitle
    except ImportError:  # (a dependency; without it only the kernel name changes)
        _kernel_name(title)
        return
    setproctitle.setproctitle(title)
    _kernel_name(title)


def _kernel_name(title: str) -> None:
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(title[:15])
    except OSError:  # not Linux, or not allowed: the name is cosmetic
        log.debug("could not set the process name", exc_info=True)


def engine_title(mode: str, rank: int, dp_size: int) -> str:
    if mode == "single":
        return "afd::engine" if dp_size == 1 else f"afd::engine-{rank}"
    return f"afd::attention-{rank}"


def ffn_title(rank: int, ranks_per_node: int) -> str:
    return f"afd::ffn-{rank // ranks_per_node}-{rank % ranks_per_node}"
