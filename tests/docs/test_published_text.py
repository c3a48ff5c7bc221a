"""Published text names no path that exists on one machine only: a reader elsewhere must be able to
follow every command and every recorded setting."""

from __future__ import annotations

import re

from tests.conftest import ROOT

# a machine's temporary, home or workspace directories (absolute), or a virtual environment's
# site-packages by absolute path
LOCAL = re.compile(r"(?<![\w.~-])/(?:tmp|var/tmp|home|root|Users|work|private/var|var/folders)/|/[\w./-]*site-packages")


def published() -> list:
    files = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("benchmarks/**/*.md")]
    files += [*ROOT.glob("benchmarks/results/*.json"), *ROOT.glob("afd_engine/**/README.md")]
    return sorted(files)


def test_no_published_text_names_a_machine_local_path():
    found = []
    for path in published():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if LOCAL.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:160]}")
    assert not found, "\n".join(found)
    assert len(published()) > 30  # README, docs pages, benchmark notes and results files


def test_the_pattern_finds_what_it_is_for():
    for line in (
        "--json /tmp/x.json",
        "cd /home/ann/afd",
        "PYTHONPATH=/root/site",
        "/opt/venv/lib/python3.11/site-packages/x",
    ):
        assert LOCAL.search(line), line
    for line in ("/dev/shm/afd-ring", "http://127.0.0.1:30000/v1/models", "benchmarks/results/x.json", "~/tmp/ok"):
        assert not LOCAL.search(line), line
