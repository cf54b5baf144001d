"""Every code snippet of README.md and docs/*.md runs as written, on the embedded model.

A fenced block in ``python``/``py`` or ``bash``/``sh``/``shell`` is a snippet; other
languages (``json``, ``text``, none) are shown, not run. A snippet may opt out with a
comment on the line just before its fence that says why:

    <!-- doc-test: skip (starts a server) -->

- Python snippets run in this process, each from a file of its own (so tracebacks
  name the document and line, and Triton can read kernel sources), as ``__main__``.
- Shell snippets run under ``bash -e -o pipefail`` in an empty directory where
  ``hybridserve``, ``python`` and ``.venv/bin/{hybridserve,python}`` are this test's
  interpreter, with ``HF_HUB_OFFLINE=1`` (nothing is downloaded). When every command
  of a snippet is ``hybridserve ARGS``, ``echo TEXT | hybridserve ARGS`` or
  ``python -c CODE`` (any of those programs' spellings above), the commands run in
  this process instead, one after the other, each with a fresh ``__main__``: the same
  programs without a process start (and a torch import) each.
- A snippet that talks to ``http://127.0.0.1:8000`` (or ``localhost:8000``) runs
  against a server started as ``hybridserve serve`` starts it with no options (the
  embedded model, its default served name), on a free port that replaces 8000.
"""

from __future__ import annotations

import os
import re
import runpy
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell"}
FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
SKIP = re.compile(r"^<!--\s*doc-test:\s*skip\b\s*(.*?)\s*-->\s*$")
SERVER_URL = re.compile(r"http://(?:127\.0\.0\.1|localhost):8000")


@dataclass(frozen=True)
class Snippet:
    document: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    skip: str | None  # the reason given, or None

    @property
    def name(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def snippets(path: Path) -> list[Snippet]:
    """The runnable fenced blocks of ``path``, with their opt-out reasons."""
    found = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, language = i, m.group(1).lower()
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path}:{start + 1}: code fence never closed")
        if language in PYTHON | SHELL:
            skip = SKIP.match(lines[start - 1]) if start else None
            found.append(Snippet(path, start + 1, language, "\n".join(lines[start + 1 : i]) + "\n",
                                 skip.group(1) if skip else None))
        i += 1
    return found


ALL = [s for doc in DOCUMENTS for s in snippets(doc)]


def test_snippets_are_found_and_opt_outs_say_why():
    names = {s.name for s in ALL}
    assert any(n.startswith("README.md") for n in names) and any(n.startswith("docs/server.md") for n in names)
    assert sum(s.skip is None for s in ALL) >= 4
    for s in ALL:
        assert s.skip is None or s.skip.strip("() "), f"{s.name}: say why the snippet is not run"


def test_the_parser_sees_markers_and_languages(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "text\n<!-- doc-test: skip (needs a GPU) -->\n```python\nimport x\n```\n"
        "```json\n{}\n```\n```bash\necho hi\n```\n```\nplain\n```\n"
    )
    found = snippets(doc)
    assert [(s.language, s.skip, s.code, s.line) for s in found] == [
        ("python", "(needs a GPU)", "import x\n", 3), ("bash", None, "echo hi\n", 9)
    ]


# ---- a server like `hybridserve serve`, for snippets that talk to one ------------------


class _Server:
    def __init__(self) -> None:
        import uvicorn

        from hybridserve import LLM
        from hybridserve.server import create_app

        # What `hybridserve serve` builds with no options, with fewer sequences.
        self.app = create_app(LLM(max_num_seqs=4))
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def doc_server() -> Iterator[_Server]:
    server = _Server()
    yield server
    server.stop()


# ---- running ---------------------------------------------------------------------------


def _shims(tmp_path: Path) -> dict[str, str]:
    """A working directory and PATH where the snippets' programs are this interpreter."""
    programs = {
        "python": f'exec "{sys.executable}" "$@"\n',
        "python3": f'exec "{sys.executable}" "$@"\n',
        "hybridserve": f'exec "{sys.executable}" -m hybridserve.cli "$@"\n',
    }
    for folder in (tmp_path / "bin", tmp_path / ".venv" / "bin"):
        folder.mkdir(parents=True, exist_ok=True)
        for name, body in programs.items():
            f = folder / name
            f.write_text("#!/bin/sh\n" + body)
            f.chmod(f.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ)
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["HF_HUB_OFFLINE"] = "1"
    return env


HYBRIDSERVE = {"hybridserve", ".venv/bin/hybridserve"}
PYTHONS = {"python", "python3", ".venv/bin/python"}


def _in_process_commands(code: str):
    """The snippet's commands as in-process calls, or None if any is of another form."""
    import shlex

    calls = []
    for line in code.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            return None
        if not words:
            continue
        stdin = None
        if words[0] == "echo" and "|" in words:
            bar = words.index("|")
            stdin, words = " ".join(words[1:bar]) + "\n", words[bar + 1 :]
        if any(w in {"|", "||", "&&", ";", ">", "<", ">>", "&"} for w in words):
            return None
        if words[0] in HYBRIDSERVE:
            calls.append(_cli_call(words[1:], stdin, line))
        elif words[0] in PYTHONS and len(words) == 3 and words[1] == "-c" and stdin is None:
            calls.append(_python_call(words[2], line))
        else:
            return None
    return calls


def _cli_call(argv: list[str], stdin: str | None, line: str):
    def run(monkeypatch) -> None:
        import io

        from hybridserve.cli import main

        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        try:
            rc = main(argv)
        except SystemExit as e:  # --help, --version
            rc = e.code
        assert rc in (0, None), f"{line!r} exited with {rc}"

    return run


def _python_call(source: str, line: str):
    def run(monkeypatch) -> None:
        exec(compile(source, line, "exec"), {"__name__": "__main__"})

    return run


def test_shell_commands_run_in_process_only_in_the_plain_forms():
    assert len(_in_process_commands('hybridserve generate "a b"  # c\necho "x y" | hybridserve generate -\n')) == 2
    assert len(_in_process_commands('.venv/bin/python -c "print(1)"\n')) == 1
    for other in ("make test\n", "hybridserve serve > log\n", "KEY=1 hybridserve serve\n",
                  "hybridserve --version && echo ok\n", "curl http://x\n"):
        assert _in_process_commands(other) is None, other


@pytest.mark.parametrize("snippet", ALL, ids=[s.name for s in ALL])
def test_snippet_runs_as_written(snippet: Snippet, request, tmp_path, monkeypatch):
    if snippet.skip is not None:
        pytest.skip(f"opted out: {snippet.skip}")
    code = snippet.code
    if SERVER_URL.search(code):
        code = SERVER_URL.sub(request.getfixturevalue("doc_server").base_url, code)
    if snippet.language in PYTHON:
        monkeypatch.chdir(tmp_path)
        # Blank lines keep the document's line numbers in tracebacks.
        file = tmp_path / (re.sub(r"\W", "_", snippet.name) + ".py")
        file.write_text("\n" * snippet.line + code)
        runpy.run_path(str(file), run_name="__main__")
        return
    commands = _in_process_commands(code)
    if commands is not None:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        for command in commands:
            command(monkeypatch)
        return
    _run_shell(snippet.name, code, tmp_path)


def _run_shell(name: str, code: str, tmp_path: Path) -> str:
    out = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", code], cwd=tmp_path, env=_shims(tmp_path),
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, f"{name} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_shell_snippets_of_other_forms_run_in_bash_with_the_programs(tmp_path):
    code = 'V=$(hybridserve --version) && echo "$V"\n.venv/bin/python -c "import hybridserve, sys; print(sys.executable)"\n'
    assert _in_process_commands(code) is None
    out = _run_shell("example", code, tmp_path).splitlines()
    assert out == ["hybridserve 0.1.0", sys.executable]
    with pytest.raises(AssertionError, match="failed"):
        _run_shell("example", "hybridserve --no-such-flag\n", tmp_path)
