"""Running a check script's parts: each under a time limit, each failure recorded (type, message, the
end of its traceback and of its cause's) while the next part runs, the report rewritten to disk
after every part. Used by kernels/gpu_check.py and kernels/tune_kernels.py; nothing here knows a GPU."""

from __future__ import annotations

import contextlib
import json
import signal
import time
import traceback
from pathlib import Path


class PartTimeout(BaseException):
    """A part ran past its limit (a BaseException: code under test must not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    def expire(signum, frame):
        raise PartTimeout(f"over its time limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def error_record(exc: BaseException, depth: int = 0) -> dict:
    """Type, message and the last traceback lines of `exc`, and the same of what caused it (a
    Triton compile or interpreter error carries the kernel's line in its cause)."""
    lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, chain=False)).splitlines()
    record = {"type": type(exc).__name__, "message": str(exc)[:8000], "traceback": lines[-25:]}
    cause = exc.__cause__ or exc.__context__
    if cause is not None and depth < 3:
        record["cause"] = error_record(cause, depth + 1)
    return record


def died(returncode: int, seconds: float, kill_after_s: float) -> dict:
    """The record of a part whose process ended without writing one."""
    if seconds >= kill_after_s:
        why = f"ran past {kill_after_s:.0f} s and was killed (a hang its time limit could not interrupt)"
    else:
        why = f"exited with status {returncode} (negative: killed by that signal) before recording a result"
    error = {"type": "PartProcessDied", "message": f"the part's process {why}", "traceback": []}
    return {"ok": False, "seconds": round(seconds, 3), "headline": error["message"][:100], "error": error}


def run_parts(parts: dict, report: dict, json_path: Path, deadline_s: float, run_one, limits: dict) -> bool:
    """Runs `parts` (name -> fn(ctx) -> dict) in order through `run_one(name, fn, limit_s) -> record`
    into report["parts"], each under its `limits` entry (default 60 s), rewriting the JSON file after
    each; a part that would start with under 5 s of `deadline_s` left is not run. Returns whether
    every part passed."""
    start = time.perf_counter()
    for name, fn in parts.items():
        left = deadline_s - (time.perf_counter() - start)
        if left < 5:
            report["parts"][name] = {"ok": False, "seconds": 0.0, "headline": "not run: --deadline-s spent"}
        else:
            report["parts"][name] = run_one(name, fn, min(limits.get(name, 60), left))
        write_json(json_path, report)
    report["ok"] = all(p["ok"] for p in report["parts"].values())
    report["finished"] = True
    write_json(json_path, report)
    return report["ok"]


def run_cases(cases: dict) -> tuple[dict, list[str]]:
    """Runs each case (name -> fn() -> dict) on its own: (its record or error, failure messages).
    A case fails by raising or by returning "ok": False."""
    records, failures = {}, []
    for name, case in cases.items():
        start = time.perf_counter()
        try:
            records[name] = case()
        except Exception as exc:
            records[name] = {"ok": False, "error": error_record(exc)}
        records[name]["seconds"] = round(time.perf_counter() - start, 3)
        if records[name].get("ok") is False:
            error = records[name].get("error")
            failures.append(f"{name}: " + (f"{error['type']}: {error['message'][:200]}" if error else "out of bounds"))
    return records, failures


def write_json(path: Path, report: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(path)


def summary(report: dict) -> str:
    lines = [f"{'part':<20} {'status':<6} {'seconds':>8}  headline"]
    for name, p in report["parts"].items():
        lines.append(f"{name:<20} {'ok' if p['ok'] else 'FAIL':<6} {p['seconds']:>8.1f}  {p.get('headline', '')}")
    return "\n".join(lines)
