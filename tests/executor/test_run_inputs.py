"""``strata run`` checks every input before the weights load: the messages file (present, JSON, a
list of ``{role, content}`` objects), the chat template (read, compiled, rendered once with the
messages), ``--prompt-ids``, an empty prompt, and the prompt's length against the plan's context.
Each bad input is a one-line error while ``Engine`` (which loads the weights) is never built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_plan_file
from gguf_factory import write_tiny_llama
from strata.executor import engine as engine_module

from strata.cli import main

CONTEXT = 256
"""The tiny plan's context (tokens): the byte-level vocabulary makes one token per byte."""

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class WeightsLoaded(Exception):
    """Raised by the patched ``Engine``: the command got as far as loading the weights."""


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    """A plan of a tiny byte-level GGUF that has a chat template."""
    folder = tmp_path_factory.mktemp("run_inputs")
    model = write_tiny_llama(folder / "tiny.gguf", chat_template=TEMPLATE)
    return make_plan_file(str(model), folder / "tiny.yaml", context=CONTEXT)


@pytest.fixture(autouse=True)
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Engine`` raises if built: every check below must come before it."""

    def refuse(*args, **kwargs) -> None:
        raise WeightsLoaded

    monkeypatch.setattr(engine_module.Engine, "__init__", refuse)


def _file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _error(capsys: pytest.CaptureFixture, plan: Path, *argv: str) -> str:
    """The one-line error of ``strata run PLAN *argv`` (exit status 2)."""
    assert main(["run", str(plan), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err[len("error: ") : -1]


CHAT = json.dumps([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("messages", "template", "expected"),
    [
        (None, None, "/absent.json: no such file"),
        ('[{"role": "user"', None, "not valid JSON"),
        ('{"role": "user", "content": "hi"}', None, "non-empty list of {role, content}"),
        ("[]", None, "non-empty list of {role, content}"),
        ('[{"role": "user", "content": 3}]', None, "messages[0].content must be a string"),
        (CHAT, None, "chat.jinja: no such file"),
        (CHAT, "{% if %}", "chat.jinja: the chat template is not valid Jinja (line 1)"),
        (CHAT, "{{ raise_exception('no user role') }}", "chat.jinja: the chat template rejected"),
        (CHAT, "{{ messages[0]['content'] + 1 }}", "chat.jinja: the chat template failed: Type"),
        (CHAT, "{{ 1 / 0 }}", "chat.jinja: the chat template failed: ZeroDivisionError"),
    ],
)
def test_bad_messages_or_template_fail_before_the_weights(
    plan: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    messages: str | None,
    template: str | None,
    expected: str,
) -> None:
    argv = [
        "--messages",
        "/absent.json" if messages is None else _file(tmp_path, "m.json", messages),
    ]
    if messages == CHAT:
        jinja = tmp_path / "chat.jinja"
        if template is not None:
            jinja.write_text(template)
        argv += ["--chat-template", str(jinja)]
    message = _error(capsys, plan, *argv)
    assert expected in message
    option = "--chat-template " if messages == CHAT else "--messages "
    assert message.startswith(option), message  # names the file at fault


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--prompt", "x" * CONTEXT], f"the prompt has {CONTEXT} tokens but the plan's context"),
        (["--prompt", ""], "the prompt is empty"),
        (["--prompt-ids", ""], "--prompt-ids '': give comma-separated integers"),
        (["--prompt-ids", "1,2,x"], "give comma-separated integers"),
        (["--prompt-ids", "1,99999"], "token id 99999 is outside the vocabulary"),
        (["--prompt", "hi", "--max-tokens", "-1"], "--max-tokens -1 is negative"),
    ],
)
def test_bad_prompt_fails_before_the_weights(
    plan: Path, capsys: pytest.CaptureFixture, argv: list[str], expected: str
) -> None:
    assert expected in _error(capsys, plan, *argv)


def test_long_chat_fails_before_the_weights(
    plan: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The rendered chat (the GGUF's template) is what is measured against the context."""
    long = json.dumps([{"role": "user", "content": "y" * CONTEXT}])
    message = _error(capsys, plan, "--messages", _file(tmp_path, "long.json", long))
    assert f"tokens but the plan's context is {CONTEXT}" in message


def test_good_inputs_reach_the_weights(plan: Path, tmp_path: Path) -> None:
    """Inputs that pass every check go on to load the weights (the patch above is what stops
    them), with the tokenizer the checks built."""
    seen = {}

    def record(self, loaded, expert_cache_mode=None, config=None, tokenizer=None) -> None:
        seen["tokenizer"] = tokenizer
        raise WeightsLoaded

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module.Engine, "__init__", record)
        for argv in (
            ["--messages", _file(tmp_path, "m.json", CHAT)],
            ["--prompt", "x" * (CONTEXT - 1), "--max-tokens", "1"],
            ["--prompt-ids", "1,2,3"],
        ):
            seen.clear()
            with pytest.raises(WeightsLoaded):
                main(["run", str(plan), *argv])
            assert seen["tokenizer"] is not None and seen["tokenizer"].chat_template == TEMPLATE
