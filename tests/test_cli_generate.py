"""The command line: `--help` and `--version` without torch, help text with defaults
and no markup, `generate`'s sampling flags, streaming, stdin and errors, and `serve
MODEL` (vLLM's positional form)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.cli import build_parser, main
from hybridserve.server.cli import apply_model_tag

ROOT = Path(__file__).resolve().parent.parent

NO_TORCH = """
import sys
from hybridserve.cli import main
for argv in ({argvs}):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
heavy = sorted(m for m in ("torch", "triton", "fastapi", "transformers") if m in sys.modules)
assert not heavy, heavy
"""


def test_help_and_version_do_not_import_torch():
    argvs = "['--help'], ['--version'], ['generate', '--help'], ['serve', '--help'], ['demo', '--help']"
    out = subprocess.run(
        [sys.executable, "-c", NO_TORCH.format(argvs=argvs)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "usage: hybridserve" in out.stdout and "hybridserve 0.1.0" in out.stdout


def _help(*argv: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_shows_defaults_and_no_markup(capsys):
    texts = {cmd: _help(*cmd, capsys=capsys) for cmd in [(), ("generate",), ("serve",), ("demo",)]}
    for text in texts.values():
        assert "``" not in text and "`" not in text and ":class:" not in text
    gen = " ".join(texts[("generate",)].split())  # argparse wraps lines
    for piece in ("--max-tokens MAX_TOKENS new tokens", "(default: 64)", "--temperature",
                  "(default: 0.0)", "--top-k", "--repetition-penalty", "--stop TEXT",
                  "--n N", "--ignore-eos", "--seed", "--num-threads", "'-' reads one prompt"):
        assert piece in gen, piece
    # Every option with a default value shows it (stated in its help or appended).
    commands = build_parser()._subparsers._group_actions[0].choices
    for name in ("generate", "serve"):
        formatter = commands[name]._get_formatter()
        for action in commands[name]._actions:
            if action.option_strings and action.nargs != 0 and action.default is not None:
                assert "default" in formatter._get_help_string(action), (name, action.dest)
    serve = " ".join(texts[("serve",)].split())
    assert "MODEL checkpoint directory or hub id" in serve and "(default: 8000)" in serve


def test_version_matches_the_package_metadata(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert capsys.readouterr().out.strip() == f"hybridserve {version}"


def _expected_text(model: Path, prompt: str, params: SamplingParams, **llm_kwargs) -> list[str]:
    out = LLM(model, max_num_seqs=4, **llm_kwargs).generate([prompt], params, use_tqdm=False)[0]
    return [c.text for c in out.outputs]


def test_generate_sampling_flags_match_the_offline_api(tiny_granite, capsys):
    argv = ["generate", "--model", str(tiny_granite), "--max-tokens", "6", "--temperature", "0.9",
            "--top-p", "0.9", "--top-k", "50", "--min-p", "0.01", "--repetition-penalty", "1.3",
            "--seed", "3", "--n", "2", "--ignore-eos", "--stop", "\x00\x01", "--max-num-seqs", "4",
            "hello"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    params = SamplingParams(n=2, max_tokens=6, temperature=0.9, top_p=0.9, top_k=50, min_p=0.01,
                            repetition_penalty=1.3, seed=3, ignore_eos=True, stop=["\x00\x01"])
    texts = _expected_text(tiny_granite, "hello", params)
    assert printed == "".join(f"--- 'hello' [{j}]\nhello{t}\n" for j, t in enumerate(texts))
    # The flags reach the sampler: greedy decoding gives something else.
    greedy = _expected_text(tiny_granite, "hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert greedy[0] not in texts


def test_generate_stop_flag_cuts_the_text(tiny_granite, capsys):
    base = ["generate", "--model", str(tiny_granite), "--max-tokens", "12", "--ignore-eos", "abc"]
    assert main(base) == 0
    full = capsys.readouterr().out.removeprefix("abc").removesuffix("\n")
    stop = full[3:5]
    assert main([*base, "--stop", stop]) == 0
    assert capsys.readouterr().out == "abc" + full[: full.index(stop)] + "\n"


class _Recorder(io.StringIO):
    """Stdout that notes how many engine steps had run at each write."""

    def __init__(self, steps: list) -> None:
        super().__init__()
        self.steps = steps
        self.writes: list[tuple[int, str]] = []

    def write(self, s: str) -> int:
        if s:
            self.writes.append((len(self.steps), s))
        return super().write(s)


def test_generate_prints_text_while_generating(tiny_granite, monkeypatch, count_calls):
    from hybridserve.engine.engine_core import EngineCore

    steps = count_calls(EngineCore, "step")
    out = _Recorder(steps)
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "--model", str(tiny_granite), "--max-tokens", "10", "--ignore-eos",
                 "def f(x):"]) == 0
    text = out.getvalue()
    expected = _expected_text(tiny_granite, "def f(x):", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert text == "def f(x):" + expected[0] + "\n"
    # Pieces of the completion were written at several different steps, the first well
    # before the last step (not all at the end).
    completion_writes = [n for n, s in out.writes[1:] if s.strip("\n")]
    assert len(set(completion_writes)) >= 3, out.writes
    assert completion_writes[0] < len(steps) - 3, (out.writes, len(steps))


def test_generate_reads_the_prompt_from_stdin(tiny_granite, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):\n    return\n"))
    assert main(["generate", "--model", str(tiny_granite), "--max-tokens", "5", "-"]) == 0
    prompt = "def f(x):\n    return"  # the one trailing newline (echo's) is dropped
    expected = _expected_text(tiny_granite, prompt, SamplingParams(max_tokens=5, temperature=0))
    assert capsys.readouterr().out == prompt + expected[0] + "\n"


def test_generate_errors_speak_of_what_the_command_takes(tiny_granite, tiny_nemotron, capsys):
    # A checkpoint without a tokenizer: no advice to pass token ids (the CLI cannot).
    assert main(["generate", "--model", str(tiny_nemotron), "hello"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json" in err and "token id" not in err
    assert main(["generate", "--model", str(tiny_granite), ""]) == 2
    err = capsys.readouterr().err
    assert "prompt 0 is empty" in err and "token id" not in err
    assert main(["generate", "--model", str(tiny_granite), "--max-model-len", "16", "x" * 40]) == 2
    err = capsys.readouterr().err
    assert "--max-model-len" in err and "40 tokens" in err and "token id" not in err
    assert main(["generate", "--model", str(tiny_granite), "-", "-"]) == 2
    assert "once" in capsys.readouterr().err


def test_generate_warns_when_max_tokens_is_capped(tiny_granite, capsys):
    argv = ["generate", "--model", str(tiny_granite), "--max-model-len", "32", "--max-tokens",
            "100", "--ignore-eos", "abcd"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("warning: prompt 0 has 4 tokens, so max_tokens=100")
    assert "capped at 28 tokens" in captured.err and captured.err.count("warning:") == 1
    params = SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)
    assert captured.out == "abcd" + _expected_text(tiny_granite, "abcd", params, max_model_len=32)[0] + "\n"


def test_serve_takes_the_model_as_a_positional_argument(tmp_path, capsys):
    args = build_parser().parse_args(["serve", "some/model", "--port", "9"])
    apply_model_tag(args)
    assert args.model == "some/model" and args.port == 9
    args = build_parser().parse_args(["serve", "--model", "x"])
    apply_model_tag(args)
    assert args.model == "x"
    args = build_parser().parse_args(["serve", "a", "--model", "a"])
    apply_model_tag(args)
    assert args.model == "a"
    # Two different models: refused before anything loads.
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "given twice" in capsys.readouterr().err
    # A positional model that does not exist is named in the error.
    assert main(["serve", str(tmp_path / "missing"), "--port", "9"]) == 2
    assert "missing" in capsys.readouterr().err
