"""A deployment's processes, found from /proc by the title each gives itself (afd_engine/proctitle.py:
`afd::attention-<rank>`, `afd::ffn-<node>-<local>`, `afd::engine`, ...)."""

from __future__ import annotations

from pathlib import Path


def _parent(stat: Path) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after the name, which may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Every descendant of `pid` (rank processes are children of the forkserver the server starts)."""
    parents = {int(stat.parent.name): _parent(stat) for stat in Path("/proc").glob("[0-9]*/stat")}
    out, frontier = [], {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier}
        out += sorted(frontier)
    return out


def title(pid: int) -> str:
    """The title a process gave itself, as `ps` shows it; "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


def titled(root: int, name: str) -> int:
    """The one descendant of `root` titled `name`; LookupError when there is none or several."""
    pids = [p for p in descendants(root) if title(p) == name]
    if len(pids) != 1:
        raise LookupError(f"{len(pids)} processes titled {name!r} among the descendants of {root}")
    return pids[0]
