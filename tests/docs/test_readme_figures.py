"""Every figure the README quotes names the results file it comes from.

The README's "## Figures" table is the front door's summary of what was measured. A figure that
names no file of `benchmarks/results/` cannot be checked or traced to its run, so each row must
link at least one such file, the file must exist and hold JSON, and the date the row gives must be
that file's (in its name or in its content).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
HEADER = "| what | figure | date, machine |"
LINK = re.compile(r"\]\((benchmarks/results/[^)\s]+\.json)\)")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def figure_rows(text: str) -> list[list[str]]:
    """The cells of each body row of the table under "## Figures" (header and rule left out)."""
    section = text.split("\n## Figures\n", 1)
    if len(section) < 2:
        return []
    body = section[1].split("\n## ", 1)[0]
    lines = body.splitlines()
    if HEADER not in lines:
        return []
    rows = []
    for line in lines[lines.index(HEADER) + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def results_links(row: list[str]) -> list[str]:
    """The `benchmarks/results/*.json` paths the row links, in order."""
    return LINK.findall(" ".join(row))


@pytest.fixture(scope="module")
def rows() -> list[list[str]]:
    return figure_rows(README.read_text())


def test_the_figures_table_is_read(rows):
    # a heading or header renamed would otherwise leave every check below with nothing to check
    assert len(rows) >= 10
    assert all(len(row) == 3 for row in rows), [row for row in rows if len(row) != 3]


def test_every_figure_links_a_results_file_that_exists_and_holds_json(rows):
    problems = []
    for what, _, _ in rows:
        links = results_links([what])
        if not links:
            problems.append(f"no benchmarks/results/*.json linked in its 'what' cell: {what[:90]}")
        for link in links:
            path = ROOT / link
            if not path.is_file():
                problems.append(f"{link} does not exist: {what[:60]}")
                continue
            try:
                json.loads(path.read_text())
            except ValueError as exc:
                problems.append(f"{link} is not JSON ({exc}): {what[:60]}")
    assert not problems, "\n".join(problems)


def test_every_figure_has_the_date_of_a_file_it_links(rows):
    problems = []
    for what, _, when in rows:
        dates = DATE.findall(when)
        if not dates:
            problems.append(f"no date in '{when}': {what[:60]}")
            continue
        files = [ROOT / link for link in results_links([what]) if (ROOT / link).is_file()]
        if not any(dates[0] in path.name or dates[0] in path.read_text() for path in files):
            problems.append(f"{dates[0]} is in none of {[p.name for p in files]}: {what[:60]}")
    assert not problems, "\n".join(problems)


def test_the_reader_finds_rows_and_links():
    text = (
        "intro\n\n## Figures\n\ntext\n\n"
        f"{HEADER}\n|---|---|---|\n"
        "| a ([results](benchmarks/results/a_2026-01-02.json)) | 1x | 2026-01-02, CPU |\n"
        "| b, no file | 2x | 2026-01-03, CPU |\n"
        "\nafter the table\n\n## Next\n\n| what | figure | date, machine |\n|---|---|---|\n| c | 3x | d |\n"
    )
    found = figure_rows(text)
    assert [row[0][:1] for row in found] == ["a", "b"]
    assert results_links(found[0]) == ["benchmarks/results/a_2026-01-02.json"]
    assert results_links(found[1]) == []
    assert figure_rows("## Elsewhere\n" + text.split("## Figures", 1)[1]) == []
