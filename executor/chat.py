"""Chat messages -> prompt text -> token ids, through the model's own Jinja chat template.

Templates are rendered the way HuggingFace renders ``tokenizer_config.json`` templates (the dialect
they are written for, and the one llama.cpp emulates): a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` block,
a ``tojson`` filter that keeps non-ASCII text, and the ``raise_exception`` and ``strftime_now``
globals.

Rendering budget. A chat template is a program, and the GGUF's is written by whoever made the
file: Jinja's sandbox stops it reaching Python's internals but not looping for hours (nested
``range(100000)`` loops), recursing, or building gigabytes (``'x' * 3e9``, ``tojson(indent=3e8)``,
a string doubled in a loop). A loop cannot be interrupted inside the process that runs it, so
templates are rendered in a worker process (``_RenderWorker``: started on first use, a few
hundred ms once, then a pipe round trip per render) with a wall-time budget
(``RENDER_TIMEOUT_S``: the worker is killed and restarted past it), a memory cap
(``RENDER_MEMORY_BYTES``: the worker's own address-space limit, and the parent watching its
resident memory where the limit is not enforced) and an output-size cap
(``MAX_RENDERED_CHARS``); every failure is a ``ChatError`` naming the template. The server,
``run --messages`` and ``chat`` all render here.

Workers. ``run --messages`` and ``chat`` render one conversation at a time: one worker (the
module's pool of one). A server has its own ``RenderPool`` of ``serve --render-workers`` workers
(``DEFAULT_RENDER_WORKERS``), one render each at a time, so that a request whose template loops
holds one worker for its budget, not every chat; a chat that gets no worker within
``RENDER_WAIT_S`` is refused (``RenderBusy``: a 503 with ``Retry-After``), never queued without
bound. The server stops its workers when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import selectors
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from typing import TYPE_CHECKING, Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from strata.common.errors import StrataError

if TYPE_CHECKING:
    from strata.executor.tokenizer import GGUFTokenizer


class ChatError(StrataError, ValueError):
    """The messages are malformed, or the chat template is missing or fails on them."""


class RenderBusy(ChatError):
    """No render worker came free within the wait (``RENDER_WAIT_S``), or the workers are
    stopped (the server is shutting down): the server's 503, not the request's fault."""


BUILTIN_TEMPLATES = {"chatml": "chatml.jinja", "gemma3": "gemma3.jinja"}
"""Chat templates shipped with Strata (``executor/templates/``), by the name ``--chat-template``
takes in place of a file."""

ARCHITECTURE_TEMPLATES = {"gemma3": "gemma3"}
"""The built-in template used for a GGUF of this ``general.architecture`` that carries none
(llama.cpp's converter writes no template for Gemma-3 base models, as the catalog's
Gemma-3-270M shows; llama.cpp itself falls back to a template picked by model too)."""

NO_TEMPLATE = (
    "this model's GGUF has no chat template (tokenizer.chat_template) and no built-in one fits "
    f"its architecture; pass --chat-template FILE (a Jinja template) or a built-in name "
    f"({', '.join(BUILTIN_TEMPLATES)}), or use --prompt"
)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and how messages and errors name it.

    Attributes:
        text: the Jinja source.
        name: e.g. "the GGUF's chat template", "--chat-template my.jinja", "the built-in gemma3
            template".
        fallback: True when it is a built-in used because the GGUF has none (worth one line to
            the user: the model was not shipped with it).
    """

    text: str
    name: str
    fallback: bool = False


def builtin_template(name: str) -> str:
    """The text of a built-in template (``BUILTIN_TEMPLATES``).

    Raises:
        ChatError: no built-in of that name.
    """
    file = BUILTIN_TEMPLATES.get(name)
    if file is None:
        raise ChatError(
            f"no built-in chat template {name!r}; built-in: {', '.join(BUILTIN_TEMPLATES)}"
        )
    return (resources.files("strata.executor") / "templates" / file).read_text(encoding="utf-8")


def chat_template_for(
    tokenizer: GGUFTokenizer, architecture: str, given: ChatTemplate | None = None
) -> ChatTemplate | None:
    """The template chats are rendered with: ``given`` (``--chat-template``), else the GGUF's,
    else the built-in one for the architecture (``ARCHITECTURE_TEMPLATES``), else None (a chat
    is then refused with ``NO_TEMPLATE``)."""
    if given is not None:
        return given
    if tokenizer.chat_template is not None:
        return ChatTemplate(tokenizer.chat_template, "the GGUF's chat template")
    name = ARCHITECTURE_TEMPLATES.get(architecture)
    if name is None:
        return None
    return ChatTemplate(builtin_template(name), f"the built-in {name} template", fallback=True)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: HF marks assistant text with it; we render it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)  # the "generation" name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> NoReturn:
    raise ChatError(f"the chat template rejected the messages: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and non-ASCII text; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> None:
    """Check that a chat template is valid Jinja, so that a syntax error shows before any model
    is opened (``strata run --chat-template`` checks its file first). Only parses: compiling
    folds constant expressions (``{{ 'x' * 3000000000 }}`` is built while compiling), which
    happens in the render worker, under its limits. The last 8 templates checked are
    remembered (a server checks its template on every chat).

    Raises:
        ChatError: the template is not valid Jinja (names the line and the problem).
    """
    try:
        _environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError(
            f"the chat template is not valid Jinja (line {e.lineno}): {e.message}"
        ) from e
    except (RecursionError, MemoryError):  # nested thousands deep: untrusted text all the same
        raise ChatError(
            "the chat template is nested too deeply to parse; fix the template or pass another "
            "with --chat-template"
        ) from None


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    """The compiled template (the last 8 kept; in the render worker only)."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError(
            f"the chat template is not valid Jinja (line {e.lineno}): {e.message}"
        ) from e


def check_messages(messages: object) -> None:
    """Refuse anything but a non-empty list of ``{"role": str, "content": str, ...}`` objects.

    Raises:
        ChatError: what is wrong, naming the first bad message by its index.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatError(f"messages[{i}] must be an object with 'role' and 'content'")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ChatError(f"messages[{i}].{key} must be a string")


RENDER_TIMEOUT_S = 2.0
"""Wall-clock seconds a chat template may take to render. A real template renders a long chat
in a few ms (gemma3's, 100 messages: under 10 ms); 2 s leaves room for a loaded machine while a
template that loops for minutes costs a request 2 s, not the server."""

MAX_RENDERED_CHARS = 32 * 2**20
"""Most characters a rendered chat may have: twice the largest request body
(``server.protocol.MAX_BODY_BYTES``, 16 MiB), since a render is the messages plus the template's
own text; far more than any plan's context holds, so only a template gone wrong reaches it."""

RENDER_MEMORY_BYTES = 1 << 30
"""Address space the render worker may grow by beyond its size at start (Linux: ``RLIMIT_AS``;
other systems only have the time and output caps). A render needs a few times its output, at
most ``MAX_RENDERED_CHARS`` characters (up to 4 bytes each in Python); past this a template gets
a ``MemoryError`` (a 400), never the server's memory. Where the limit is not enforced (a sandbox
may ignore ``RLIMIT_AS``), the parent kills a worker whose resident memory grew by more than this
(checked every ``RSS_POLL_S`` while it renders; Python cannot watch itself: ``'x' * 3e9`` is one C
call holding the GIL)."""

RSS_POLL_S = 0.01
"""Seconds between the parent's looks at a rendering worker's resident memory (Linux
``/proc/PID/statm``): at a few GB/s of growth the worker passes its cap by tens of MB at most."""


WORKER_START_S = 30.0
"""Seconds the render worker may take to start (a Python process importing Jinja: about 0.1 s
idle; far longer while a 2-core machine loads a model), apart from each render's budget."""

MAX_REPLY_BYTES = 12 * MAX_RENDERED_CHARS + 1024
"""Longest reply line read from the worker: the text as ASCII JSON, at most 6 bytes a
character (``\\uXXXX``), with room for the rest of the object."""

MAX_ERROR_CHARS = 300
"""Longest error message of a render (a template's ``raise_exception`` text included)."""

DEFAULT_RENDER_WORKERS = 2
"""Render workers of a server (``serve --render-workers``). A template that loops holds one
worker for its whole ``RENDER_TIMEOUT_S``; with two, one such request leaves the other chats a
worker, while each idle worker costs a Python process with Jinja loaded (about 30 MB)."""

MAX_RENDER_WORKERS = 16
"""Most render workers a server may have (``serve --render-workers``): each is a process, and a
real render takes milliseconds, so more only multiply what hostile templates can take."""

RENDER_WAIT_S = 5.0
"""Seconds a server's chat waits for a free render worker before a 503: two rounds of renders
cut at ``RENDER_TIMEOUT_S`` (and a worker restart each) end within it, while a client sees a
refusal within seconds, well under the usual HTTP client timeouts, however many hostile
requests queue up."""

RENDER_RETRY_AFTER_S = math.ceil(RENDER_TIMEOUT_S)
"""``Retry-After`` (seconds) of that 503: a busy worker is free again within one render's
budget."""

_STOPPED = "the chat template workers are stopped: the server is shutting down; retry elsewhere"


def render_chat(
    template: str,
    messages: list[dict],
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool = True,
    name: str = "the chat template",
    lease: RenderLease | None = None,
    tools: list[dict] | None = None,
) -> str:
    """Render ``messages`` with a chat template into the prompt text, in a render worker
    (see the module's "Rendering budget"): at most ``RENDER_TIMEOUT_S`` seconds and
    ``MAX_RENDERED_CHARS`` characters.

    Args:
        template: the Jinja chat template (e.g. the GGUF's ``tokenizer.chat_template``).
        messages: ``[{"role": str, "content": str, ...}, ...]`` (JSON values); extra keys are
            passed through.
        bos_token, eos_token: the texts of the model's BOS/EOS tokens, for templates using them.
        add_generation_prompt: end with the header that opens the assistant's reply.
        name: how errors name the template (``ChatTemplate.name``).
        lease: the worker to render in (a server's ``RenderPool.lease_async``), released as soon
            as the render ends; None: the module's single worker, waited for.
        tools: the functions the model may call, as HF's ``apply_chat_template(tools=...)``
            takes them (``[{"type": "function", "function": {"name", "description",
            "parameters"}}]``); None: no tools (the template's ``tools`` is none).

    Returns:
        The rendered text (special tokens appear as text, e.g. ``<|im_start|>``).

    Raises:
        ChatError: malformed messages, a template that is not valid Jinja, fails while rendering
            (a Jinja or a Python error), calls ``raise_exception``, or exceeds the time, memory
            or size budget.
    """
    check_messages(messages)
    compile_template(template)  # a syntax error, said here without a round trip
    job = {
        "template": template,
        "messages": messages,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "add_generation_prompt": add_generation_prompt,
        "tools": tools,
    }
    try:
        json.dumps(job, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ChatError(f"the messages are not JSON values: {e}") from None
    reply = (lease or _pool.lease(None)).render(job, name)
    if "error" in reply:
        raise ChatError(_one_line(reply["error"].replace("the chat template", name, 1)))
    return reply["text"]


def _one_line(message: str) -> str:
    """An error message on one line of at most ``MAX_ERROR_CHARS`` characters (a template's own
    ``raise_exception`` text, or Python's, may hold anything)."""
    text = " ".join(message.split())
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 1] + "…"
    return text.encode("ascii", "backslashreplace").decode() if not text.isprintable() else text


def _render_here(job: dict) -> str:
    """The render itself (in the worker). Raises ChatError as ``render_chat`` says."""
    try:
        text = _compiled(job["template"]).render(
            messages=job["messages"],
            tools=job.get("tools"),
            documents=None,
            add_generation_prompt=job["add_generation_prompt"],
            bos_token=job["bos_token"],
            eos_token=job["eos_token"],
        )
    except ChatError:  # raise_exception: the template's own verdict on the messages
        raise
    except jinja2.TemplateError as e:
        raise ChatError(f"the chat template failed: {e}") from e
    except MemoryError:
        raise _OutOfMemory(_out_of_memory()) from None
    except RecursionError:
        raise ChatError(
            "the chat template recursed too deeply (a macro or loop that calls itself without "
            "end?); fix the template or pass another with --chat-template"
        ) from None
    except Exception as e:  # e.g. {{ 1 / 0 }} or {{ 'a' + 1 }}: Python errors of the template's
        raise ChatError(f"the chat template failed: {type(e).__name__}: {e}") from e
    if len(text) > MAX_RENDERED_CHARS:
        raise ChatError(_too_long(len(text)))
    return text


class _OutOfMemory(ChatError):
    """A render ran out of its memory: the worker gives its memory back by starting afresh."""


def _out_of_memory() -> str:
    return (
        f"the chat template needed over {RENDER_MEMORY_BYTES >> 20} MiB to render; "
        "fix the template or pass another with --chat-template"
    )


def _resident_bytes(pid: int) -> int | None:
    """Resident memory of process ``pid`` in bytes (Linux ``/proc/PID/statm``), or None where it
    cannot be read (no /proc, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _too_long(chars: int) -> str:
    return (
        f"the chat template rendered over {MAX_RENDERED_CHARS >> 20} Mi characters"
        f"{f' ({chars})' if chars else ''}; fix the template or pass another with --chat-template"
    )


class _RenderWorker:
    """The process templates are rendered in (``python -P -m strata.executor.chat``: the
    current folder is not on its path), one JSON line per job on its stdin, one per reply on its
    stdout, each reply carrying its job's number; started on first use (it says ``ready`` once
    its imports are done, within ``WORKER_START_S``), restarted after it is killed (a render
    over ``RENDER_TIMEOUT_S``, or any failure between a job and its reply: a late reply is never
    read as the next job's) or exits (after a ``MemoryError``). Its renders are serialized (a
    lock); a ``RenderPool`` hands each worker to one render at a time. The worker runs in a
    session of its own (a terminal's Ctrl-C is the parent's to handle) and exits when its stdin
    closes or its parent goes away, or is killed by ``close``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._rss_at_start: int | None = None  # bytes; None where /proc cannot tell
        self._jobs = 0
        self._closed = False

    @property
    def running(self) -> bool:
        """Whether its process is up (a hint, read without the lock: a free running worker is
        handed out before one that would have to start)."""
        proc = self._proc
        return proc is not None and proc.poll() is None

    def close(self) -> None:
        """Kill the process for good, even mid-render (that render ends in a ``ChatError``), and
        wait for it: no process outlives this call, and none is started after it."""
        self._closed = True
        proc = self._proc
        if proc is not None:  # a render in progress holds the lock: end it first
            with contextlib.suppress(OSError):
                proc.kill()
        with self._lock:
            self._kill()

    def start(self) -> None:
        """Start the worker now (``serve`` does, so the first chat pays no start-up)."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> subprocess.Popen:
        """The running worker, started (and waited for) where there is none.

        Raises:
            ChatError: it did not start (said as such, not as the template's fault).
        """
        if self._closed:
            raise RenderBusy(_STOPPED)
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "strata.executor.chat", "--render-worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True,
            )
            try:
                ready = self._read_line(time.monotonic() + WORKER_START_S)
            except (OSError, TimeoutError):
                ready = b""
            if ready != b'"ready"\n':
                self._kill()
                raise ChatError(
                    f"the chat template worker did not start within {WORKER_START_S:g} s "
                    "(python -m strata.executor.chat); try again"
                )
            self._rss_at_start = _resident_bytes(self._proc.pid)
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
            self._proc = None

    def _read_line(self, deadline: float, watch_memory: bool = False) -> bytes:
        """One line of the worker's stdout, by ``deadline`` (``time.monotonic``);
        ``watch_memory``: look at its resident memory every ``RSS_POLL_S`` meanwhile.

        Raises:
            TimeoutError: not by the deadline.
            OSError: the worker closed its stdout (it exited).
            ValueError: a line longer than any reply may be.
            _OutOfMemory: its resident memory grew past ``RENDER_MEMORY_BYTES``.
        """
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        limit = None
        if watch_memory and self._rss_at_start is not None:
            limit = self._rss_at_start + RENDER_MEMORY_BYTES
        out = bytearray()
        with selectors.DefaultSelector() as sel:  # not select(): descriptors past 1024
            sel.register(fd, selectors.EVENT_READ)
            while not out.endswith(b"\n"):
                # Past the deadline one last look without waiting: a reply that came while this
                # thread was not scheduled (a loaded machine) is read, not taken for a timeout.
                left = max(deadline - time.monotonic(), 0.0)
                if not sel.select(left if limit is None else min(left, RSS_POLL_S)):
                    if left <= 0:
                        raise TimeoutError
                    rss = None if limit is None else _resident_bytes(self._proc.pid)
                    if rss is not None and rss > limit:
                        raise _OutOfMemory(_out_of_memory())
                    continue
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise BrokenPipeError("the render worker exited")
                out += chunk
                if len(out) > MAX_REPLY_BYTES:
                    raise ValueError("reply too long")
        return bytes(out)

    def render(self, job: dict, name: str) -> dict:
        """The worker's reply to one job: ``{"text": ...}`` or ``{"error": ...}``.

        Raises:
            ChatError: the render ran out of time or output room, or the worker died.
        """
        with self._lock:
            proc = self._ensure()
            self._jobs += 1
            number = self._jobs
            try:
                line = json.dumps({**job, "job": number}, ensure_ascii=False)
                assert proc.stdin is not None
                proc.stdin.write(line.encode() + b"\n")
                proc.stdin.flush()
                out = self._read_line(time.monotonic() + RENDER_TIMEOUT_S, watch_memory=True)
                reply = json.loads(out)
                if not isinstance(reply, dict) or reply.get("job") != number:
                    raise ValueError("a reply to another job")
            except _OutOfMemory as e:
                self._kill()
                raise ChatError(str(e).replace("the chat template", name, 1)) from None
            except TimeoutError:
                self._kill()
                raise ChatError(
                    f"{name} took over {RENDER_TIMEOUT_S:g} s to render (a loop without end?); "
                    "fix the template or pass another with --chat-template"
                ) from None
            except ValueError:
                self._kill()
                raise ChatError(_too_long(0).replace("the chat template", name, 1)) from None
            except OSError:  # the worker died (a pipe closed under us)
                self._kill()
                if self._closed:  # killed by close(): not the template's doing
                    raise RenderBusy(_STOPPED) from None
                raise ChatError(
                    f"{name} crashed the render worker; fix the template or pass another "
                    "with --chat-template"
                ) from None
            except BaseException:  # Ctrl-C, MemoryError ...: its reply must not be the next's
                self._kill()
                raise
            if reply.get("restart"):  # the worker exits to give its memory back
                self._kill()
            return reply


class RenderLease:
    """One worker of a ``RenderPool``, taken for one render and given back by ``release`` (which
    ``render`` calls when the render ends; releasing twice is harmless)."""

    def __init__(self, pool: RenderPool, worker: _RenderWorker) -> None:
        self._pool = pool
        self._worker: _RenderWorker | None = worker
        self._lock = threading.Lock()

    def render(self, job: dict, name: str) -> dict:
        """``_RenderWorker.render`` in the leased worker, which is then given back.

        Raises:
            ChatError: as ``_RenderWorker.render``; the lease was released already.
        """
        worker = self._worker
        if worker is None:
            raise ChatError("a render worker lease was used after its release")
        try:
            return worker.render(job, name)
        finally:
            self.release()

    def release(self) -> None:
        """Give the worker back to the pool (once)."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            self._pool.give(worker)


class RenderPool:
    """``size`` render workers (``_RenderWorker``, each started on first use and restarted after
    a kill, in the thread that renders), each lent to one render at a time. A render waits for a
    free worker at most its wait (``lease``'s or ``lease_async``'s ``wait_s``), then gets
    ``RenderBusy``; a server waits on its event loop (``lease_async``), holding no thread.
    A free worker whose process runs is lent before one that would have to start.

    Attributes:
        size: the number of workers (1..``MAX_RENDER_WORKERS``).
        wait_s: the default wait of ``lease_async``, seconds (``RENDER_WAIT_S``).
    """

    def __init__(self, size: int = 1, wait_s: float = RENDER_WAIT_S) -> None:
        """No process starts here (see ``start``).

        Raises:
            ChatError: ``size`` outside 1..``MAX_RENDER_WORKERS``.
        """
        if not 1 <= size <= MAX_RENDER_WORKERS:
            raise ChatError(
                f"render workers: {size}; give 1..{MAX_RENDER_WORKERS} (--render-workers)"
            )
        self.size = size
        self.wait_s = wait_s
        self._workers = [_RenderWorker() for _ in range(size)]
        self._free = list(self._workers)
        self._cond = threading.Condition()
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._closed = False

    def start(self) -> None:
        """Start one worker now (``serve`` does, so that the first chat pays no start-up; the
        others start when renders overlap)."""
        lease = self.lease(None)
        try:
            assert lease._worker is not None
            lease._worker.start()
        finally:
            lease.release()

    def _take(self) -> _RenderWorker | None:
        """A free worker, a running one first, or None (under ``_cond``).

        Raises:
            RenderBusy: the pool is closed.
        """
        if self._closed:
            raise RenderBusy(_STOPPED)
        for i, worker in enumerate(self._free):
            if worker.running:
                return self._free.pop(i)
        return self._free.pop() if self._free else None

    def _busy(self, wait_s: float) -> RenderBusy:
        return RenderBusy(
            f"chat template renders are all busy: none of the {self.size} render workers "
            f"(serve --render-workers) came free within {wait_s:g} s; retry after "
            f"{RENDER_RETRY_AFTER_S} s"
        )

    def lease(self, wait_s: float | None) -> RenderLease:
        """A worker, waited for in this thread at most ``wait_s`` seconds (None: without bound,
        for a pool that only one conversation uses).

        Raises:
            RenderBusy: none came free in time, or the pool is closed.
        """
        deadline = None if wait_s is None else time.monotonic() + wait_s
        with self._cond:
            while (worker := self._take()) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    assert wait_s is not None
                    raise self._busy(wait_s)
                self._cond.wait(left)
        return RenderLease(self, worker)

    async def lease_async(self, wait_s: float | None = None) -> RenderLease:
        """A worker, waited for on the running event loop at most ``wait_s`` seconds (None: the
        pool's ``wait_s``); workers given back go to waiting tasks first come, first served.

        Raises:
            RenderBusy: none came free in time, or the pool is closed.
        """
        wait = self.wait_s if wait_s is None else wait_s
        loop = asyncio.get_running_loop()
        with self._cond:
            worker = self._take()
            if worker is not None:
                return RenderLease(self, worker)
            waiter = (loop, loop.create_future())
            self._waiters.append(waiter)
        future = waiter[1]
        try:
            return RenderLease(self, await asyncio.wait_for(future, wait))
        except BaseException as e:
            # A worker handed over in the loop turn where the wait ended (timed out, or the task
            # cancelled: Python 3.12's wait_for then raises with the result set) goes back.
            if future.done() and not future.cancelled() and future.exception() is None:
                self.give(future.result())
            if isinstance(e, TimeoutError):
                raise self._busy(wait) from None
            raise
        finally:
            with self._cond, contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def give(self, worker: _RenderWorker) -> None:
        """Take a worker back (from any thread): handed to the first waiting task, else to a
        waiting thread, else kept free."""
        with self._cond:
            if self._closed:
                worker.close()  # killed already; a render that ended after close returns it
                return
            while self._waiters:
                loop, future = self._waiters.popleft()
                try:
                    loop.call_soon_threadsafe(self._hand, future, worker)
                    return
                except RuntimeError:  # that loop is closed: its task is gone
                    continue
            self._free.append(worker)
            self._cond.notify()

    def _hand(self, future: asyncio.Future, worker: _RenderWorker) -> None:
        """On the waiting task's loop: the worker is its, unless it stopped waiting meanwhile."""
        if future.done():
            self.give(worker)
        else:
            future.set_result(worker)

    def close(self) -> None:
        """Kill every worker, those rendering included, and wait for them: no worker process
        outlives this call; later leases get ``RenderBusy``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for worker in self._workers:
            worker.close()


_pool = RenderPool(1)
"""The worker of ``run --messages`` and ``chat``: one conversation renders at a time."""


def _worker_main() -> None:
    """The render worker's loop (see ``_RenderWorker``)."""
    parent = os.getppid()

    def watch_parent() -> None:  # an orphan mid-render would otherwise run on
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    try:
        import resource

        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        cap = size + RENDER_MEMORY_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except (ImportError, OSError, ValueError):
        pass  # no /proc (macOS) or no limit allowed: the time and size caps still hold
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(b'"ready"\n')  # imports done: the parent's render budget starts now
    stdout.flush()
    for raw in stdin:
        exit_after = False
        job: dict = {}
        try:
            job = json.loads(raw)
            reply: dict = {"text": _render_here(job)}
        except _OutOfMemory as e:
            reply, exit_after = {"error": str(e)}, True  # give the memory back: start afresh
        except ChatError as e:
            reply = {"error": str(e)}
        except MemoryError:
            reply, exit_after = {"error": _out_of_memory()}, True
        except ValueError as e:  # not a job's JSON line: said, not a traceback on stderr
            reply = {"error": f"the render worker got a line that is not a job: {e}"}
        reply["job"] = job.get("job") if isinstance(job, dict) else None
        if exit_after:
            reply["restart"] = True
        stdout.write(json.dumps(reply, ensure_ascii=True).encode() + b"\n")
        stdout.flush()
        if exit_after:
            return


def messages_to_ids(
    tokenizer: GGUFTokenizer,
    messages: list[dict],
    template: str | None = None,
    add_generation_prompt: bool = True,
    name: str = "the chat template",
    lease: RenderLease | None = None,
    tools: list[dict] | None = None,
) -> list[int]:
    """Prompt token ids for a chat, as llama.cpp builds them.

    Renders ``messages`` with ``template`` (default: the GGUF's; ``name``: how errors name it),
    tokenizes the text with special tokens recognised, and prepends BOS only when the GGUF asks
    for it and the rendered text does not already start with it (templates that write
    ``{{ bos_token }}`` must not get two). No EOS is appended, whatever ``add_eos_token`` says:
    the prompt ends with the reply's header. ``lease``: the worker to render in (see
    ``render_chat``), given back before the text is tokenized; ``tools``: the functions the
    template renders (see ``render_chat``).

    Raises:
        ChatError: no template (neither given nor in the GGUF), malformed messages, or a template
            failure (see ``render_chat``).
    """
    if template is None:
        template, name = tokenizer.chat_template, "the GGUF's chat template"
    if template is None:
        raise ChatError(NO_TEMPLATE)
    bos = _token_text(tokenizer, tokenizer.bos_id)
    eos = _token_text(tokenizer, tokenizer.eos_id)
    text = render_chat(template, messages, bos, eos, add_generation_prompt, name, lease, tools)
    ids = tokenizer.encode(text, add_bos=False, parse_special=True, add_eos=False)
    if tokenizer.add_bos and not (bos and text.startswith(bos)):
        ids.insert(0, tokenizer.bos_id)
    return ids


def _token_text(tokenizer: GGUFTokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.token_text(token_id)


if __name__ == "__main__" and sys.argv[1:] == ["--render-worker"]:
    _worker_main()
