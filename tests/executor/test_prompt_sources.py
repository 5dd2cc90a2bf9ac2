"""``strata run``'s prompt from a file (``--prompt-file FILE``) or from standard input
(``--prompt -``): the same tokens as the text given with ``--prompt``, and one-line errors for a
missing file, text that is not UTF-8, or a second prompt option."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, make_plan_file
from gguf_factory import write_tiny_llama

from strata.cli import main

TEXT = "Dear café,\nmore lines — and a final newline\n"
"""Non-ASCII, several lines, a trailing newline: all of it is the prompt."""


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    """A plan of a tiny byte-level GGUF (one token per byte)."""
    folder = tmp_path_factory.mktemp("prompt_sources")
    model = write_tiny_llama(folder / "tiny.gguf")
    return make_plan_file(str(model), folder / "tiny.yaml", context=256)


@pytest.fixture(scope="module")
def expected_ids(plan: Path) -> list[int]:
    from strata.executor.plan_loader import peek_plan
    from strata.executor.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(peek_plan(plan).gguf).encode(TEXT)


def _json_run(capsys: pytest.CaptureFixture, plan: Path, *argv: str) -> dict:
    assert main(["run", str(plan), "--json", "--max-tokens", "1", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_prompt_file_is_the_prompt(plan, tmp_path, capsys, expected_ids):
    path = tmp_path / "prompt.txt"
    path.write_text(TEXT, encoding="utf-8")
    from_file = _json_run(capsys, plan, "--prompt-file", str(path))
    assert from_file["prompt_ids"] == expected_ids
    assert from_file["prompt_ids"] == _json_run(capsys, plan, "--prompt", TEXT)["prompt_ids"]


def test_prompt_from_standard_input(plan, expected_ids):
    """``--prompt -`` in a real process, the text piped to it."""
    done = subprocess.run(
        [sys.executable, "execute.py", "run", str(plan), "--prompt", "-", "--json"]
        + ["--max-tokens", "1"],
        cwd=ROOT,
        input=TEXT.encode(),
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout)["prompt_ids"] == expected_ids
    assert b"reading the prompt" not in done.stderr  # a pipe is not told how to end it


def _error(capsys: pytest.CaptureFixture, plan: Path, *argv: str) -> str:
    assert main(["run", str(plan), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_bad_prompt_files_are_one_line_errors(plan, tmp_path, capsys):
    missing = tmp_path / "absent.txt"
    assert f"--prompt-file {missing}: no such file" in _error(
        capsys, plan, "--prompt-file", str(missing)
    )
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    assert "not UTF-8 text" in _error(capsys, plan, "--prompt-file", str(latin1))
    empty = tmp_path / "empty.txt"
    empty.write_text("")  # as --prompt '': refused once tokenized (this GGUF adds no BOS)
    assert "the prompt is empty" in _error(capsys, plan, "--prompt-file", str(empty))
    assert "the prompt is empty" in _error(capsys, plan, "--prompt", "")
    done = subprocess.run(
        [sys.executable, "execute.py", "run", str(plan), "--prompt", "-"],
        cwd=ROOT,
        input="café".encode("latin-1"),
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count(b"\n") == 1, done.stderr
    assert b"--prompt -: standard input is not UTF-8 text" in done.stderr


def test_one_prompt_source_at_a_time(plan, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(plan), "--prompt", "x", "--prompt-file", str(tmp_path / "p.txt")])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
