"""mkdocs hook: the benchmarks, planner and deploy READMEs live beside their code, and the site
carries them as pages of its own (under `reference/`, see PAGES), so that a reader of the site
reaches every table and method without a clone. Links relative to a README's folder (its
results files, say) become repository paths in code, since the site does not carry those files;
links into docs/ stay links."""

from __future__ import annotations

import os
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent

# site page -> the README it is made from (its relative links start from the README's folder)
PAGES = {
    "reference/benchmarks.md": "benchmarks/README.md",
    "reference/planner.md": "afd_engine/planner/README.md",
    "reference/kubernetes.md": "deploy/kubernetes/README.md",
    "reference/grafana.md": "deploy/grafana/README.md",
}

LINK = re.compile(r"\[([^\]]+)\]\((?!https?://|#)([^)\s]+)\)")


def absorbed(readme: str) -> str:
    """The README's text as a site page: a note naming its source, relative links as repository
    paths."""
    folder = Path(readme).parent
    text = (ROOT / readme).read_text()

    def as_path(m: re.Match) -> str:
        target = os.path.normpath(folder / m.group(2)).replace(os.sep, "/")
        if target.startswith("docs/"):  # a page of the site: linked from reference/
            return f"[{m.group(1)}](../{target.removeprefix('docs/')})"
        return f"{m.group(1)} (`{target}`)"

    body = LINK.sub(as_path, text)
    note = f"<!-- generated from {readme} at build time: edit that file, not this page -->\n"
    return note + body


def on_files(files, config):
    for page, readme in PAGES.items():
        files.append(File.generated(config, page, content=absorbed(readme)))
    return files
