"""Every example in docs/*.md runs, so the documentation cannot rot.

A fenced block tagged bash/sh/shell or python/py is an example. The nearest non-blank line above its
fence may hold a marker:

- `<!-- not run: REASON -->`, REASON one of NOT_RUN_REASONS: the block is shown as a skipped test
  (`run by tests/benchmarks`: every benchmark script it calls has a test of its own that runs it,
  which a test here checks);
- `<!-- run: with a server -->`: the block runs against one `afd serve` (embedded default model,
  default flags) started for this module, with every `30000` replaced by that server's port; these
  blocks run in page order;
- no marker: the block runs on its own.

Bash blocks run with `bash -e -c`, python blocks with this interpreter from a temporary file; both
from the repository root, the interpreter's bin directory first on PATH, AFD_TEST_THREADS=1, at most
BLOCK_TIMEOUT seconds each. Each block must be self-contained: under `pytest -n 2` blocks may run on
different workers, each with its own server. Any other marker, a marker that is not directly above
a code block, or an unclosed fence fails test_markers_valid, which names page and line.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.process_helpers import afd_start, free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
BLOCK_TIMEOUT = 120.0
SERVER_START_TIMEOUT = 120.0
PORT_PLACEHOLDER = "30000"

# info-string language -> how the block runs
EXAMPLE_LANGS = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
NOT_RUN_REASONS = (
    "needs a GPU",
    "needs several machines",
    "needs Slurm",
    "starts a long-running server",
    "takes minutes",
    "needs network access",
    "run by tests/benchmarks",  # each script of the block has a test that runs it (checked below)
)
RUN_BY_BENCH_TESTS = "run by tests/benchmarks"
SERVER = "with a server"

FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not run|run)\s*:\s*(?P<arg>.*?)\s*-->\s*$")
# anything that looks like an attempt at a marker, so that a misspelt one fails instead of being ignored
MARKER_LIKE = re.compile(r"^\s*<!--\s*(?:not[\s_-]*)?run\b", re.IGNORECASE)


@dataclass(frozen=True)
class Block:
    """A fenced code block of a page: `line` is its opening fence's (1-based), `runner` "bash",
    "python" or "" (not an example), `marker` "" (none), "server" or "not run: REASON"."""

    page: str
    line: int
    lang: str
    code: str
    runner: str
    marker: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _language(info: str) -> str:
    """The language of a fence's info string: its first word, `{.bash ...}` and `.bash` accepted."""
    words = info.strip().lstrip("{").split()
    return words[0].lstrip(".").rstrip("}").lower() if words else ""


def parse_markdown(text: str, page: str) -> tuple[list[Block], list[str]]:
    """The fenced code blocks of a markdown text and the marker errors, each "page:line: message".

    Fences follow CommonMark: three or more backticks or tildes, closed by a line of at least as
    many of the same character and nothing else; a backtick fence's info string has no backtick.
    Fences may be indented (inside list items); the indentation is removed from the block's lines.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    errors: list[str] = []
    pending: tuple[int, str] | None = None  # (line, marker) waiting for its fence
    i = 0
    while i < len(lines):
        raw = lines[i]
        opening = FENCE_OPEN.match(raw)
        if opening and opening["fence"][0] == "`" and "`" in opening["info"]:
            opening = None  # inline code such as ```x``` on a line of its own, not a fence
        if opening:
            start = i + 1
            indent, fence = len(opening["indent"]), opening["fence"]
            closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
            body: list[str] = []
            i += 1
            while i < len(lines) and not closing.match(lines[i]):
                line = lines[i]
                strip = len(line) - len(line.lstrip(" \t"))
                body.append(line[min(indent, strip) :])
                i += 1
            if i == len(lines):
                errors.append(f"{page}:{start}: fence {fence} is never closed")
            lang = _language(opening["info"])
            runner = EXAMPLE_LANGS.get(lang, "")
            marker = ""
            if pending is not None:
                marker_line, marker = pending
                if marker == "server" and not runner:
                    errors.append(
                        f"{page}:{marker_line}: `<!-- run: {SERVER} -->` above a `{lang or 'untagged'}` block,"
                        f" which is not an example (only {', '.join(EXAMPLE_LANGS)} blocks run)"
                    )
                elif marker == "invalid":
                    runner = ""  # reported already; not run
                pending = None
            blocks.append(Block(page, start, lang, "\n".join(body) + "\n" if body else "", runner, marker))
            i += 1
            continue
        if raw.strip():
            if pending is not None:
                errors.append(f"{page}:{pending[0]}: marker is not directly above a code block")
                pending = None
            if MARKER_LIKE.match(raw):
                pending = (i + 1, _check_marker(raw, page, i + 1, errors))
        i += 1
    if pending is not None:
        errors.append(f"{page}:{pending[0]}: marker is not directly above a code block")
    return blocks, errors


def _check_marker(line: str, page: str, lineno: int, errors: list[str]) -> str:
    """The marker a line holds ("server", "not run: REASON"), or "invalid" with an error added."""
    m = MARKER.match(line)
    if m is None:
        errors.append(
            f"{page}:{lineno}: malformed marker {line.strip()!r}; write `<!-- run: {SERVER} -->`"
            " or `<!-- not run: REASON -->` alone on its line"
        )
        return "invalid"
    if m["kind"] == "run":
        if m["arg"] == SERVER:
            return "server"
        errors.append(f"{page}:{lineno}: unknown marker {line.strip()!r}; the only run marker is `run: {SERVER}`")
        return "invalid"
    if m["arg"] in NOT_RUN_REASONS:
        return f"not run: {m['arg']}"
    errors.append(
        f"{page}:{lineno}: unknown reason {m['arg']!r} in {line.strip()!r}; allowed: " + "; ".join(NOT_RUN_REASONS)
    )
    return "invalid"


def docs_pages(docs: Path = DOCS) -> list[Path]:
    """docs/**/*.md, hidden folders left out, in name order."""
    if not docs.is_dir():
        return []
    return sorted(p for p in docs.rglob("*.md") if not any(part.startswith(".") for part in p.relative_to(docs).parts))


def collect(docs: Path = DOCS, readme: Path | None = None) -> tuple[list[Block], list[str]]:
    """The blocks and marker errors of docs/**/*.md and, when given, the README (its blocks run
    like the pages')."""
    blocks: list[Block] = []
    errors: list[str] = []
    pages = [(path, path.relative_to(docs).as_posix()) for path in docs_pages(docs)]
    for path, name in pages + ([(readme, readme.name)] if readme is not None and readme.is_file() else []):
        b, e = parse_markdown(path.read_text(encoding="utf-8"), name)
        blocks += b
        errors += e
    return blocks, errors


def block_env() -> dict[str, str]:
    bindir = str(Path(sys.executable).parent)
    return {**os.environ, "AFD_TEST_THREADS": "1", "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies, which nobody may reap here, do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[2] == str(pgid) and fields[0] not in "ZX":
            return True
    return False


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # gone already, or not ours
        os.killpg(pgid, sig)


def run_block(runner: str, code: str, timeout: float = BLOCK_TIMEOUT) -> tuple[int | None, str]:
    """Runs one example; (exit status, None on timeout; its stdout and stderr merged). The block runs
    in a session of its own, so whatever it left running is killed with it."""
    with tempfile.TemporaryDirectory(prefix="afd-doc-example-") as tmp:
        if runner == "python":
            script = Path(tmp) / "example.py"
            script.write_text(code, encoding="utf-8")
            argv = [sys.executable, str(script)]
        else:
            argv = ["bash", "-e", "-c", code]
        with open(Path(tmp) / "output", "w+", encoding="utf-8", errors="replace") as out:
            proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=block_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                rc: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                _kill_group(proc.pid)
                proc.wait()
            out.seek(0)
            return rc, out.read()


class DocsServer:
    """`afd serve --port <free port>` (embedded default model, default flags) in a session of its
    own, its output collected by a thread so that a full pipe never blocks it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = afd_start("serve", "--port", str(self.port), new_session=True)
        self._output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        try:
            while True:
                if self.proc.poll() is not None:
                    self._reader.join(timeout=5)
                    raise RuntimeError(f"afd serve exited with {self.proc.returncode}:\n{self.output()}")
                try:
                    wait_healthy(self.url, timeout=1)
                    return
                except AssertionError:
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"afd serve not healthy within {SERVER_START_TIMEOUT:.0f} s:\n{self.output()}"
                        ) from None
        except BaseException:
            self.stop(kill=True)
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._output.append(line)

    def output(self, tail: int = 6000) -> str:
        return "".join(self._output)[-tail:]

    def stop(self, kill: bool = False) -> None:
        """SIGTERM to the server's process group (SIGKILL when `kill`), SIGKILL to what is left after 15 s."""
        _kill_group(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):  # what is left is killed below
            self.proc.wait(timeout=15)
        deadline = time.monotonic() + 5  # its children, shutting down after it
        while time.monotonic() < deadline and _group_alive(self.proc.pid):
            time.sleep(0.1)
        _kill_group(self.proc.pid)
        self.proc.wait()
        self._reader.join(timeout=5)


@pytest.fixture(scope="module")
def docs_server():
    server = DocsServer()
    yield server
    server.stop()


BLOCKS, MARKER_ERRORS = collect(readme=REPO / "README.md")


def _params() -> list:
    """The example blocks: those with a server first, then the others, each group in page order."""
    examples = [b for b in BLOCKS if b.runner]
    ordered = [b for b in examples if b.marker == "server"] + [b for b in examples if b.marker != "server"]
    return [
        pytest.param(
            b, id=b.id, marks=[pytest.mark.skip(reason=f"{b.id}: {b.marker}")] if b.marker.startswith("not run") else []
        )
        for b in ordered
    ]


def test_markers_valid():
    assert not MARKER_ERRORS, "invalid code-block markers in docs/ and README.md:\n" + "\n".join(MARKER_ERRORS)


def bench_scripts_without_tests(blocks: list[Block], tests_dir: Path) -> list[str]:
    """Blocks marked `not run: run by tests/benchmarks`: each benchmark they run (`python -m
    benchmarks.[PACKAGE.]NAME`, or `benchmarks/NAME.py`) must have tests_dir/test_NAME.py naming
    NAME (it runs it); page:line and script of those that do not."""
    missing = []
    for b in blocks:
        if b.marker != f"not run: {RUN_BY_BENCH_TESTS}":
            continue
        scripts = re.findall(r"-m benchmarks\.(?:\w+\.)*(\w+)|benchmarks/(?:\w+/)*(\w+)\.py", b.code)
        scripts = [module or path for module, path in scripts]
        if not scripts:
            missing.append(f"{b.id}: calls no benchmark script")
        for name in scripts:
            test = tests_dir / f"test_{name}.py"
            if not test.exists() or not re.search(rf"\b{name}\b", test.read_text()):
                missing.append(f"{b.id}: benchmarks/{name}.py has no test in {test}")
    return missing


def test_blocks_said_to_be_run_by_benchmark_tests_are():
    missing = bench_scripts_without_tests(BLOCKS, REPO / "tests" / "benchmarks")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("block", _params())
def test_example(block: Block, request):
    server = request.getfixturevalue("docs_server") if block.marker == "server" else None
    code = block.code.replace(PORT_PLACEHOLDER, str(server.port)) if server else block.code
    if server is not None and server.proc.poll() is not None:
        pytest.fail(f"the docs server exited with {server.proc.returncode}:\n{server.output()}", pytrace=False)
    rc, output = run_block(block.runner, code)
    if rc == 0:
        return
    status = f"timed out after {BLOCK_TIMEOUT:.0f} s" if rc is None else f"exited with {rc}"
    numbered = "\n".join(f"{block.line + n:5d}  {text}" for n, text in enumerate(code.splitlines(), start=1))
    msg = f"docs/{block.id}: {block.lang} block {status}\n--- block:\n{numbered}\n--- output:\n{output[-8000:]}"
    if server is not None:
        msg += f"\n--- afd serve on port {server.port} (last output):\n{server.output()}"
    pytest.fail(msg, pytrace=False)


# ---- the parser and runner themselves ----


def _parse(text: str) -> tuple[list[Block], list[str]]:
    return parse_markdown(text, "p.md")


def test_fences_languages_and_lines():
    blocks, errors = _parse(
        "# Title\n"
        "\n"
        "```bash\n"
        "echo one\n"
        "```\n"
        "~~~ python title='x.py'\n"
        "print(2)\n"
        "~~~\n"
        "```console\n"
        "$ afd serve\n"
        "```\n"
        "```sh\n"
        "```\n"
        "```{.py}\n"
        "x = 1\n"
        "```\n"
        "```\n"
        "untagged\n"
        "```\n"
    )
    assert errors == []
    assert [(b.line, b.lang, b.runner) for b in blocks] == [
        (3, "bash", "bash"),
        (6, "python", "python"),
        (9, "console", ""),
        (12, "sh", "bash"),
        (14, "py", "python"),
        (17, "", ""),
    ]
    assert blocks[0].code == "echo one\n" and blocks[1].code == "print(2)\n" and blocks[3].code == ""
    assert blocks[0].id == "p.md:3"


def test_backticks_inside_tilde_and_longer_fences():
    blocks, errors = _parse(
        "~~~markdown\n"
        "<!-- run: with a server -->\n"
        "```bash\n"
        "curl http://127.0.0.1:30000/health\n"
        "```\n"
        "~~~\n"
        "````md\n"
        "```python\n"
        "print(1)\n"
        "```\n"
        "````\n"
        "```bash\n"
        "echo ```not a fence```\n"
        "~~~\n"
        "```\n"
    )
    assert errors == []
    assert [(b.line, b.lang, b.runner) for b in blocks] == [(1, "markdown", ""), (7, "md", ""), (12, "bash", "bash")]
    assert blocks[0].code.splitlines()[1] == "```bash"
    assert blocks[2].code == "echo ```not a fence```\n~~~\n"


def test_indented_fence_in_a_list():
    blocks, errors = _parse("1. Start it:\n\n    ```bash\n    echo a\n      echo b\n    ```\n")
    assert errors == []
    assert [(b.line, b.runner, b.code) for b in blocks] == [(3, "bash", "echo a\n  echo b\n")]


def test_markers():
    blocks, errors = _parse(
        "A block below `<!-- run: with a server -->` runs against a server.\n"
        "<!-- not run: needs a GPU -->\n"
        "```bash\n"
        "afd serve --device cuda\n"
        "```\n"
        "<!-- run: with a server -->\n"
        "\n"
        "```python\n"
        "print(1)\n"
        "```\n"
        "<!--not run:   takes minutes-->\n"
        "```console\n"
        "```\n"
        "\n"
        "```bash\n"
        "true\n"
        "```\n"
    )
    assert errors == []
    assert [b.marker for b in blocks] == ["not run: needs a GPU", "server", "not run: takes minutes", ""]


def test_unknown_reason_and_marker_rejected():
    blocks, errors = _parse(
        "text\n"
        "<!-- not run: needs a TPU -->\n"
        "```bash\n"
        "false\n"
        "```\n"
        "<!-- run: twice -->\n"
        "```bash\n"
        "```\n"
        "<!-- Run: with a server -->\n"
        "```bash\n"
        "```\n"
        "<!-- not-run: needs a GPU -->\n"
        "```bash\n"
        "```\n"
    )
    assert len(errors) == 4
    assert errors[0].startswith("p.md:2: unknown reason 'needs a TPU'")
    assert errors[1].startswith("p.md:6: unknown marker")
    assert errors[2].startswith("p.md:9: malformed marker") and errors[3].startswith("p.md:12: malformed marker")
    assert [b.runner for b in blocks] == ["", "", "", ""]  # never run


def test_marker_must_be_directly_above_an_example():
    _, errors = _parse(
        "<!-- not run: needs a GPU -->\n"
        "Some text.\n"
        "```bash\n"
        "```\n"
        "<!-- run: with a server -->\n"
        "```json\n"
        "{}\n"
        "```\n"
        "<!-- not run: needs Slurm -->\n"
        "```text\n"
        "```\n"
        "<!-- run: with a server -->\n"
    )
    assert errors == [
        "p.md:1: marker is not directly above a code block",
        "p.md:5: `<!-- run: with a server -->` above a `json` block, which is not an example"
        " (only bash, sh, shell, python, py blocks run)",
        "p.md:12: marker is not directly above a code block",
    ]


def test_unclosed_fence():
    blocks, errors = _parse("````bash\necho a\n```\n~~~~\n")
    assert errors == ["p.md:1: fence ```` is never closed"]
    assert blocks[0].code == "echo a\n```\n~~~~\n"


def test_collect_pages(tmp_path):
    assert collect(tmp_path / "missing") == ([], [])
    (tmp_path / "a.md").write_text("```bash\ntrue\n```\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("<!-- run: never -->\n```bash\n```\n")
    (tmp_path / "sub" / "c.html").write_text("```bash\nfalse\n```\n")
    blocks, errors = collect(tmp_path)
    assert [b.id for b in blocks] == ["a.md:1", "sub/b.md:2"]
    assert len(errors) == 1 and errors[0].startswith("sub/b.md:1: unknown marker")


def test_run_block_bash_stops_at_first_failure_with_venv_first():
    rc, out = run_block("bash", 'echo "$AFD_TEST_THREADS ${PATH%%:*}"\nfalse\necho after\n')
    assert rc == 1
    assert out == f"1 {Path(sys.executable).parent}\n"


def test_run_block_python_from_repo_root():
    rc, out = run_block("python", "import os, sys\nprint(sys.executable, os.getcwd())\nraise SystemExit(3)\n")
    assert rc == 3 and out == f"{sys.executable} {REPO}\n"


def test_run_block_timeout_kills_what_it_started():
    start = time.monotonic()
    rc, out = run_block("bash", "sleep 60 &\necho $!\nsleep 60\n", timeout=1)
    assert rc is None and time.monotonic() - start < 10
    time.sleep(0.5)
    try:
        state = Path(f"/proc/{int(out)}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "X"  # gone
    assert state in "ZX"  # the background sleep is gone, or a zombie nobody reaps
