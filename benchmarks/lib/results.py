"""The benchmarks' result files: JSON stamped with when, where and on what code it was measured.

Every record written here starts with
  * ``date``: UTC, ISO 8601, to the second;
  * ``machine``: host name, CPU count and platform;
  * ``device``: the CUDA device's name, or "cpu";
  * ``commit``: ``git rev-parse HEAD`` of this checkout, or null outside one.
so that a figure can be traced to its run long after the file was copied elsewhere.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAMP_KEYS = ("date", "machine", "device", "commit")


def stamp() -> dict:
    """The four fields every result file starts with."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "device": device(),
        "commit": commit(),
    }


@functools.cache
def machine() -> dict:
    return {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "platform": platform.platform()}


@functools.cache
def device() -> str:
    """The name of CUDA device 0, or "cpu" where there is none (or no torch)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


@functools.cache
def commit() -> str | None:
    """The checked-out commit; None where this is no git checkout or git is missing."""
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() or None if res.returncode == 0 else None


def stamped(record: dict) -> dict:
    """`record` after the stamp; a record holding a stamp key itself is a mistake, not overwritten."""
    clash = [k for k in STAMP_KEYS if k in record]
    if clash:
        raise ValueError(f"a result record must not set {clash}: the result writer adds them")
    return {**stamp(), **record}


def write_json(path: str | Path, record: dict) -> Path:
    """Writes `record`, stamped, as indented JSON to `path` (its directory made if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamped(record), indent=2) + "\n")
    return path


def append_jsonl(path: str | Path, record: dict) -> None:
    """Appends `record`, stamped, as one line to the JSON Lines file `path`."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(stamped(record)) + "\n")
