"""The documentation site as `make docs` builds it: strictly (a warning such as a broken link fails
the build) and carrying the READMEs that live beside their code (benchmarks, planner, deploy) as
pages of its own."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from docs_hooks.readmes import PAGES, absorbed
from tests.conftest import ROOT


def make_docs_command(site: Path) -> list[str]:
    """The mkdocs command line of the Makefile's `docs` target, with its variables filled in."""
    recipe = re.search(r"^docs:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    (line,) = [ln.strip() for ln in recipe.splitlines() if "mkdocs" in ln]
    line = line.replace("$(VENV)/bin/mkdocs", f"{sys.executable} -m mkdocs").replace("$(CURDIR)/site", str(site))
    return shlex.split(line)


@pytest.fixture
def project(tmp_path):
    """What the site is built from, copied so that a test may break it."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    for folder in ["docs", "docs_hooks"]:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for readme in PAGES.values():
        (tmp_path / readme).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / readme, tmp_path / readme)
    return tmp_path


def build(project: Path) -> subprocess.CompletedProcess:
    cmd = make_docs_command(project / "site")
    return subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
def test_the_site_builds_with_the_readmes_as_pages(project):
    done = build(project)
    assert done.returncode == 0, done.stderr
    for page, readme in PAGES.items():
        html = (project / "site" / page.removesuffix(".md") / "index.html").read_text()
        title = (ROOT / readme).read_text().splitlines()[0].lstrip("# ")
        assert title.replace("`", "") in re.sub(r"<[^>]+>", "", html), page


@pytest.mark.timeout(300)
def test_a_broken_link_fails_the_build(project):
    page = project / "docs" / "faq.md"
    page.write_text(page.read_text() + "\nSee [nowhere](no-such-page.md).\n")
    done = build(project)
    assert done.returncode != 0
    assert "no-such-page.md" in done.stderr


def test_relative_links_become_repository_paths_and_links_into_docs_stay_links():
    bench = absorbed("benchmarks/README.md")
    assert "](results/" not in bench and "(`benchmarks/results/" in bench
    grafana = absorbed("deploy/grafana/README.md")
    assert "](../api.md#prometheus-metrics)" in grafana
    assert grafana.startswith("<!-- generated from deploy/grafana/README.md")
