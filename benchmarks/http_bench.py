"""``strata bench --concurrency``: a plan served over the real HTTP API, measured.

The bench starts ``strata serve PLAN`` as a subprocess on a free loopback port (with a random
API key, so nothing else on the machine can send it requests), waits for ``/health``, and drives
``POST /v1/completions`` with streamed (server-sent events) requests from an ``aiohttp`` asyncio
client, exactly as an OpenAI client would. The client is aiohttp, not httpx, because the client's
own overhead lands in every TTFT the bench reports (measured: ``docs/benchmarks.md``, Serving);
vLLM's serving benchmark uses aiohttp for the same reason. The server is always stopped
(SIGTERM, then SIGKILL after ``SERVER_STOP_TIMEOUT_S``), on success, errors and Ctrl-C alike.
With ``--batch-invariant`` the server is started with it (``ServingEngine``'s batch-invariant
mode, meant to make the text check below hold on every backend), and the figures show what the
mode costs.

Workload. Every request is greedy (temperature 0) with ``ignore_eos`` (a server extension, as in
vLLM), so it generates exactly ``--max-tokens`` tokens. Request ``i`` of a level sends prompt
``i``: deterministic text of seeded English words whose length cycles through ``--prompt-tokens``
(default ``PROMPT_TOKENS``; capped so that prompt + max_tokens fit the plan's context); prompts
differ from their first words on, so they share no prefix-cache block.

Levels. For each concurrency ``c`` (ascending; 1 is added when missing: it is the reference) a
closed loop keeps ``c`` requests in flight until the level's requests have completed. Requests
per level: ``--requests`` at every level, or by default ``max(2c, 8)`` at level ``c``, except
level 1, which runs as many as the largest level because it is the text reference of every
prompt. One server serves every level. It keeps finished prompts in its prefix cache, which
would serve level 2's prompts from the KV that level 1 left, so before each level (and before
the prefix-cache test) the bench empties it (``POST /reset_prefix_cache``): every level starts
cold and TTFTs are comparable, without paying a fresh server's start (the model's load and, on
MLX's CUDA backend, the kernels built at each shape's first use: tens of seconds) per level.

Warm-up (not measured) before each level, so that first-use costs (kernel builds, allocator
growth) are not in the figures: one request per distinct prompt token count the level sends that
no earlier level sent, one at a time (every prefill shape; level 1 sends every count), then, above
level 1, ``min(c, max_num_seqs)`` short requests of other prompts at once (the decode batch
shapes), ``WARMUP_MAX_TOKENS`` tokens each; then the prefix-cache reset.

Measured per request (client side, ``time.perf_counter``):
- TTFT: request sent -> first streamed chunk carrying a token's text, seconds;
- TPOT: (last token's chunk time - first token's chunk time) / (completion tokens - 1), seconds.
  The server sends one chunk per token while the client keeps up, and merges tokens into one
  chunk when it falls behind; the formula holds over the whole request either way;
- per-request decode tok/s: 1 / TPOT (None when every token came in one chunk).

Per level: aggregate decode throughput (completion tokens / wall time of the level, first
request sent to last request done, tokens/s) and its ratio to level 1's; p50/p99 (numpy's linear
interpolation; with few requests p99 is close to the maximum), mean and extremes of TTFT, TPOT
and per-request decode tok/s; and from ``/metrics`` read before and after the level (and sampled
every ``METRICS_POLL_S`` during it): prefix-cache hit and query tokens, preemptions, engine
steps and batched tokens (their ratio is the mean batch), the server's own TTFT/TPOT means, and
the sampled peaks of KV blocks in use, running and waiting requests. A concurrency above the
plan's ``max_num_seqs`` runs; the level says ``queued`` (at most ``max_num_seqs`` requests run at
once, the others wait in the scheduler and their TTFT includes the wait).

Checks. Every request must finish with ``length`` after exactly ``max_tokens`` tokens (else the
bench stops: its figures would be wrong). Each prompt's completion text at every level must equal
its text at concurrency 1, or leave it only by a near-tie flip: on MLX's CUDA backend a row's
rounding depends on the step's row count (not with ``--batch-invariant``), which can flip a token
whose top-2 logits nearly tie, and every later token with it. For each text that differs the
bench asks the idle server for the prompt's concurrency-1 completion again with ``logprobs: 2``
and token ids, finds the first token the text did not continue, and passes it only if the text
took the runner-up there and the top-2 gap is below ``--near-tie-gap`` (``NEAR_TIE_GAP``, 1.0 for
random-weight synthetic models: ``default_near_tie_gap``; 0 with
``--batch-invariant``, where any difference is an error). Any other mismatch sets the level's
and the result's ``check_passed`` to false. The command writes the JSON and plot, then exits
with an error that names the failed mismatches.

Prefix cache. With ``--prefix-tokens N`` (default 1000; 0 skips it), after the last level and a
prefix-cache reset: a prompt made of an ``N``-token document and a short suffix A is sent once
(cold, TTFT measured), then the same document with a different suffix B of the same kind (warm:
the prefix cache serves the document's KV: its full blocks, and the cold prompt's block where the
document ends, lent up to the first token that differs). On a GPU both are first sent once before
the reset, so that kernels for their shapes are built then; on the CPU nothing warms them up (no
kernels are built there; it saves test time), so the cold TTFT includes any first use of its
prefill shape. Reported: both TTFTs, warm / cold, the
``prefix_hit_tokens`` counter delta of each request (the warm one must be > 0, else the check
fails) and the warm response's ``usage.prompt_tokens_details.cached_tokens``.

JSON (``-o``; every time in seconds, every rate in tokens/s):

- ``kind``: ``"serving"``; ``plan``, ``model``; ``batch_invariant`` (the server ran
  ``--batch-invariant``); ``measured_at`` (local time, ISO 8601).
- ``machine``: ``platform``, ``machine``, ``python``, ``cpu_count``, ``ram_bytes``,
  ``mlx_version``, ``mlx_device`` and ``mlx_device_info``.
- ``plan_limits``: ``context``, ``objective`` and ``concurrency`` the plan was made for,
  ``predicted_decode_tok_s`` (aggregate, at the plan's batch; None without a prediction), and
  ``batch``: the plan's batch limits (``max_num_seqs``, ``max_num_batched_tokens``,
  ``kv_block_size``, ``kv_num_blocks``, ``prefill_chunk``).
- ``settings``: ``concurrency`` (the levels run), ``added_level_1``, ``max_tokens``,
  ``requests`` (``{"c": n}``), ``prefix_tokens``, ``temperature``, ``ignore_eos``,
  ``server_per_level`` (false: one server, its prefix cache reset before each level),
  ``prompt_lengths`` (the target lengths, cycled), ``prompt_tokens`` (the token count of each
  prompt, by index).
- ``levels``: one object per level: ``concurrency``, ``requests``, ``queued`` (and ``note`` when
  queued), ``wall_s``, ``completion_tokens``, ``aggregate_tok_s``, ``vs_level_1`` (aggregate
  tok/s / level 1's), ``ttft_s``, ``tpot_s`` and ``request_decode_tok_s`` (each ``p50``, ``p99``,
  ``mean``, ``min``, ``max``), ``server`` (``prefix_hit_tokens``, ``prefix_query_tokens``,
  ``preemptions``, ``engine_steps``, ``batched_tokens``, ``compiled_pass_traces``,
  ``compiled_pass_replays`` (``executor.pass_graph``), ``mean_batched_tokens_per_step``,
  ``server_ttft_mean_s``, ``server_tpot_mean_s``, ``kv_blocks_total``, ``kv_blocks_peak``,
  ``running_peak``, ``waiting_peak``; None where ``/metrics`` lacks the series; peaks are
  sampled every ``METRICS_POLL_S`` during the level, None where no sample fell inside it),
  ``warmup`` (``requests``, ``prompt_tokens``: the token counts warmed one at a time,
  ``concurrent``: the short requests sent at once, ``max_tokens``, ``wall_s``; not measured),
  ``check_passed``, ``mismatched_prompts``, ``near_tie_flips`` (how many of those passed as
  near-tie flips) and ``per_request`` (``prompt``,
  ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``ttft_s``, ``tpot_s``,
  ``decode_tok_s``, ``finish_reason``).
- ``scaling``: ``{"c": aggregate tok/s at c / at 1}``.
- ``texts``: each prompt's completion at concurrency 1 (the reference), by index.
- ``prefix_cache`` (None when skipped): ``prefix_tokens`` (the document's tokens, exact),
  ``cold_prompt_tokens``, ``warm_prompt_tokens``, ``shared_prefix_tokens``,
  ``expected_hit_tokens`` (the shared prefix: its whole KV blocks, and the rest where that is
  at least ``executor.block_pool.lend_min_tokens`` and the cold prompt filled the block that
  holds it, except on a batch-invariant server, which lends no partial blocks), ``cold_ttft_s``
  and
  ``warm_ttft_s`` (medians over ``--prefix-trials`` pairs: ``PREFIX_TRIALS`` on a GPU, one on
  the CPU),
  ``warm_over_cold``, ``cold_server_ttft_s`` and ``warm_server_ttft_s`` (the server's own
  TTFTs, submission to first token, from its histogram: medians of the trials that have one;
  per trial, the client's less the server's is what the HTTP path added), ``cold_hit_tokens``,
  ``warm_hit_tokens`` (counter deltas, first trial),
  ``warm_cached_tokens`` (from ``usage``), ``trials`` (each trial's TTFTs, hit tokens and the
  warm request's ``warm_compiled_traces`` and ``warm_compiled_replays``, the server TTFTs),
  ``check_passed`` (every warm request hit).
- ``mismatches``: ``[{"concurrency", "prompt", "first_difference" (character offset),
  "expected", "got", "reference_reproduced", "token_index", "reference_token", "runner_up",
  "gap", "runner_up_taken", "near_tie"}]`` (``classify_divergence``); ``near_tie_gap``;
  ``check_passed``: every level's check and the prefix check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import json
import math
import os
import platform
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO, TypeVar

from strata.common.errors import StrataError

if TYPE_CHECKING:
    import aiohttp
    from strata.executor.tokenizer import GGUFTokenizer

T = TypeVar("T")


PROMPT_TOKENS = (48, 96, 160, 256, 64, 128, 200, 32)
"""Default prompt lengths, tokens (``--prompt-tokens``); prompt ``i`` takes entry ``i % len``, at
most the room the context leaves next to ``max_tokens``."""
MIN_PROMPT_TOKENS = 8
"""Fewest prompt tokens the context must leave room for next to ``max_tokens``."""
MIN_REQUESTS = 8
"""Least requests of a level by default (``max(2c, MIN_REQUESTS)`` at concurrency ``c``)."""
WARMUP_PROMPT_TOKENS = 8
"""Prompt tokens of each concurrent warm-up request (not measured: it is there for the decode
batch shapes, so its prefill is kept short)."""
WARMUP_MAX_TOKENS = 2
"""Tokens generated by each warm-up request (a prefill, then one decode step)."""
PREFIX_TOKENS = 1000
"""Default tokens of the shared document in the prefix-cache test (``--prefix-tokens``)."""
PREFIX_SUFFIX_TOKENS = 16
"""Tokens of the distinct suffix after the shared document in the prefix-cache test."""
PREFIX_MAX_TOKENS = 1
"""Tokens generated by each prefix-cache request: only its TTFT is measured."""
PREFIX_TRIALS = 3
"""Cold/warm pairs of the prefix-cache test on a GPU, each after a reset; the medians are
reported (one pair's TTFTs of tens of milliseconds moved by 2x from run to run on the H200)."""
SERVER_START_TIMEOUT_S = 600.0
"""Seconds the server gets to load the plan and answer ``/health``."""
SERVER_STOP_TIMEOUT_S = 30.0
"""Seconds the server gets to stop after SIGTERM before it is killed."""
METRICS_POLL_S = 0.5
"""Seconds between ``/metrics`` samples during a level (peaks of KV blocks, queue)."""
STDERR_TAIL_CHARS = 600
"""Characters of the server's stderr quoted when it fails."""
CONNECT_TIMEOUT_S = 30.0
"""Seconds a request may wait for a connection (from the pool, or a new one)."""
HEALTH_TIMEOUT_S = 30.0
"""Seconds each start-up probe (``/health``, ``/v1/models``) may wait for its answer."""
STREAM_LINE_BYTES = 1 << 22
"""Longest response line (bytes) the client reads, 4 MiB: aiohttp's stream reader raises on a
line longer than twice its ``read_bufsize`` (the default is 256 KiB in aiohttp 3.14, 64 KiB in
older releases), and a streamed chunk that merges many tokens of JSON-escaped text must never
reach that; ``_session`` sets ``read_bufsize`` to half of this."""

_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot right "
    "study book eye job word business issue side kind head house service friend father power hour "
    "game line end member law car city community name president team minute idea kid body "
    "information back parent face others level office door health person art war history party "
    "result change morning reason research girl guy moment air teacher force education river "
    "garden music table window bridge market island forest letter mountain winter summer ocean "
    "train lamp stone bread paper glass ship engine tower valley"
).split()
_VERBS = (
    "finds keeps builds holds brings writes reads opens leaves moves follows carries shows "
    "changes meets helps turns watches starts learns explains remembers considers"
).split()


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def parse_positive_ints(option: str, text: str, example: str) -> list[int]:
    """The comma-separated positive integers of ``option`` (e.g. ``--concurrency 1,2,4``).

    Raises:
        StrataError: an empty list or item, or an item that is not a positive integer.
    """
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise StrataError(
            f"{option} {text!r}: give comma-separated positive integers, e.g. {example}"
        )
    out = []
    for t in items:
        try:
            n = int(t)
        except ValueError:
            raise StrataError(
                f"{option} {text!r}: {t!r} is not an integer; give e.g. {example}"
            ) from None
        if n < 1:
            raise StrataError(f"{option} {text!r}: {n} is not positive; give e.g. {example}")
        out.append(n)
    return out


def parse_concurrency(text: str) -> list[int]:
    """The concurrency levels of ``--concurrency`` (e.g. ``1,2,4``), ascending.

    Raises:
        StrataError: an empty list, an item that is not a positive integer, or a repeated level.
    """
    levels = parse_positive_ints("--concurrency", text, "1,2,4,8")
    if len(set(levels)) != len(levels):
        raise StrataError(f"--concurrency {text!r}: a level is repeated; give each level once")
    return sorted(levels)


def requests_per_level(levels: list[int], requests: int | None) -> dict[int, int]:
    """Requests to complete at each level (the module docstring says why level 1 runs most).

    Args:
        levels: the concurrency levels, ascending, 1 among them.
        requests: ``--requests`` (the same at every level), or None for the default.

    Raises:
        StrataError: ``requests`` is below 1 or below the highest level.
    """
    if requests is not None:
        if requests < max(levels):
            raise StrataError(
                f"--requests {requests} is below --concurrency {max(levels)}: a level keeps c "
                f"requests in flight, so it needs at least c; give --requests {max(levels)} or "
                "more, or leave it out (default max(2c, 8) per level)"
            )
        return {c: requests for c in levels}
    n = {c: max(2 * c, MIN_REQUESTS) for c in levels}
    n[1] = max(n.values())
    return n


def queue_note(concurrency: int, max_num_seqs: int) -> str | None:
    """Why a level's requests queue in the server, or None when they all run at once."""
    if concurrency <= max_num_seqs:
        return None
    return (
        f"concurrency {concurrency} exceeds the plan's max_num_seqs {max_num_seqs}: at most "
        f"{max_num_seqs} requests run at once, the others wait in the scheduler (their TTFT "
        "includes the wait)"
    )


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def _words(seed: str, n: int) -> list[str]:
    """``n`` words of deterministic sentence-like text (seeded; the same on every run)."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        subject, obj = rng.choice(_WORDS), rng.choice(_WORDS)
        extra = [rng.choice(_WORDS) for _ in range(rng.randint(2, 8))]
        out += ["The", subject, rng.choice(_VERBS), "the", obj, "of", "the", *extra[:-1]]
        out.append(extra[-1] + ".")
    return out[:n]


def make_text(tok: GGUFTokenizer, seed: str, n_tokens: int) -> tuple[str, int]:
    """Deterministic text of about ``n_tokens`` tokens: the most whole words whose tokens do
    not exceed ``n_tokens`` (a word more would).

    Returns:
        ``(text, its token count as the server's tokenizer counts it)``.
    """

    def count(k: int) -> int:
        return len(tok.encode(" ".join(words[:k])))

    words = _words(seed, n_tokens + 8)  # every word is at least one token
    lo, hi = 1, len(words)
    while lo < hi:  # the largest k with count(k) <= n_tokens; counts only grow with k
        mid = (lo + hi + 1) // 2
        if count(mid) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    return text, len(tok.encode(text))


# --------------------------------------------------------------------------------------------
# The server process
# --------------------------------------------------------------------------------------------


class ServerProcess:
    """``strata serve`` as a subprocess on a free loopback port; a context manager that
    always stops it.

    Args:
        command: the server's command line; ``serve_command`` gives the usual one. It must print
            ``serving NAME on http://HOST:PORT`` to stderr once it accepts requests.
        api_key: the key the server was given (``--api-key``).
        start_timeout_s: seconds the server gets to answer ``/health`` (``start``).
    """

    def __init__(
        self, command: list[str], api_key: str, start_timeout_s: float = SERVER_START_TIMEOUT_S
    ):
        self.command = command
        self.start_timeout_s = start_timeout_s
        self.api_key = api_key
        self.url = ""
        self.model = ""
        self.proc: subprocess.Popen | None = None
        fd, name = tempfile.mkstemp(prefix="strata-serve-", suffix=".log")
        os.close(fd)  # the server's stderr goes here; reopened for it in start()
        self._log = Path(name)

    @staticmethod
    def serve_command(plan: Path, api_key: str, batch_invariant: bool = False) -> list[str]:
        """``strata serve PLAN`` (this interpreter's ``-m strata``, so an installed package needs
        no clone) on 127.0.0.1, any free port, with ``api_key`` (and ``--batch-invariant``)."""
        return [sys.executable, "-m", "strata", "serve", str(plan.resolve())] + [
            "--host",
            "127.0.0.1",
            "--port",
            "0",  # the server binds a free port itself and prints it: no race for the port
            "--api-key",
            api_key,
            *(["--batch-invariant"] if batch_invariant else []),
        ]

    def stderr_tail(self) -> str:
        """The end of the server's stderr on one line (lines joined by `` | ``)."""
        try:
            text = self._log.read_text(errors="replace")
        except OSError:
            return ""
        tail = " | ".join(ln.strip() for ln in text.splitlines() if ln.strip())
        return tail[-STDERR_TAIL_CHARS:] if tail else "(no output)"

    def start(self) -> None:
        """Start the server and wait until ``/health`` answers.

        Raises:
            StrataError: the server exited, or did not come up within ``start_timeout_s``
                seconds (the message quotes the end of its stderr).
        """
        timeout_s = self.start_timeout_s
        with open(self._log, "wb") as err:
            self.proc = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
            )
        deadline = time.monotonic() + timeout_s
        while not self.url:
            m = re.search(r"serving .+ on (http://\S+)", self._log.read_text(errors="replace"))
            if m:
                self.url = m.group(1)
            elif self.proc.poll() is not None:
                raise StrataError(
                    f"the server did not start (exit status {self.proc.returncode}): "
                    f"{self.stderr_tail()}"
                )
            elif time.monotonic() > deadline:
                raise StrataError(
                    f"the server did not start within {timeout_s:.0f} s: {self.stderr_tail()}"
                )
            else:
                time.sleep(0.1)
        self.model = asyncio.run(self._await_ready(deadline))

    async def _await_ready(self, deadline: float) -> str:
        """Poll ``/health`` until it answers 200 (until ``deadline``, ``time.monotonic``), then
        return the served model's id from ``/v1/models``."""
        import aiohttp

        assert self.proc is not None
        timeout = aiohttp.ClientTimeout(
            total=None, connect=HEALTH_TIMEOUT_S, sock_read=HEALTH_TIMEOUT_S
        )
        async with _session(self.url, timeout, 1) as client:
            while True:
                try:
                    async with client.get("/health") as r:
                        await r.read()
                        if r.status == 200:
                            break
                except (aiohttp.ClientError, TimeoutError):
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise StrataError(
                        f"the server at {self.url} never answered /health: {self.stderr_tail()}"
                    )
                await asyncio.sleep(0.1)
            auth = {"Authorization": f"Bearer {self.api_key}"}
            try:
                async with client.get("/v1/models", headers=auth) as r:
                    status, raw = r.status, await r.read()
            except (aiohttp.ClientError, TimeoutError) as e:
                raise StrataError(
                    f"the server at {self.url} did not answer GET /v1/models: {_failure(e)}; "
                    f"server stderr: {self.stderr_tail()}"
                ) from None
        try:
            return json.loads(raw)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise StrataError(
                f"the server at {self.url} answered GET /v1/models with HTTP "
                f"{status}, not a model list: {raw.decode(errors='replace')[:200]}"
            ) from None

    def stop(self) -> None:
        """Stop the server: SIGTERM (its graceful shutdown), SIGKILL after
        ``SERVER_STOP_TIMEOUT_S`` seconds; the log file is removed."""
        proc, self.proc = self.proc, None
        try:
            if proc is not None and proc.poll() is None:
                # SIGTERM, not SIGINT: a bench started in the background ignores SIGINT, and the
                # server would inherit that.
                proc.terminate()
                try:
                    proc.wait(SERVER_STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            self._log.unlink(missing_ok=True)

    def failed(self, what: str) -> StrataError:
        """An error for a request that failed, with the server's state and stderr tail."""
        state = "" if self.proc is None or self.proc.poll() is None else " (the server exited)"
        return StrataError(f"{what}{state}; server stderr: {self.stderr_tail()}")

    def __enter__(self) -> ServerProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------
# Requests and metrics
# --------------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """One streamed completion as the client saw it (times from ``time.perf_counter``, s)."""

    prompt: int
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    t_sent: float
    t_first: float
    t_last: float

    @property
    def ttft_s(self) -> float:
        """Request sent -> first token's chunk, seconds."""
        return self.t_first - self.t_sent

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, seconds (None for one token)."""
        if self.completion_tokens < 2:
            return None
        return (self.t_last - self.t_first) / (self.completion_tokens - 1)

    @property
    def decode_tok_s(self) -> float | None:
        """This request's decode speed, tokens/s (None when no time passed between chunks)."""
        tpot = self.tpot_s
        return 1 / tpot if tpot else None


def _greedy_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A ``/v1/completions`` body for exactly ``max_tokens`` greedy tokens."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


async def stream_completion(
    client: aiohttp.ClientSession, model: str, prompt: str, max_tokens: int, index: int = -1
) -> RequestResult:
    """Send one greedy streamed ``/v1/completions`` request with ``ignore_eos`` and time it
    (``index``: the prompt's index, in messages and the result; negative for other requests).

    Raises:
        StrataError: an HTTP error status, an error event in the stream, a stream line longer
            than ``STREAM_LINE_BYTES``, or a stream that ends without a finish reason.
        aiohttp.ClientError, TimeoutError: the request failed (``_on_server`` reports them).
    """
    from aiohttp.http_exceptions import LineTooLong

    body = {
        **_greedy_body(model, prompt, max_tokens),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    what = f"prompt {index}" if index >= 0 else "the request"
    texts: list[str] = []
    finish, usage = None, {}
    t_first = t_last = None
    t_sent = time.perf_counter()
    async with client.post("/v1/completions", json=body) as r:
        if r.status != 200:
            message = _error_message(await r.read())
            raise StrataError(f"{what}: HTTP {r.status}: {message}")
        try:
            # One line per iteration, its b"\n" included (the last one may lack it).
            async for raw in r.content:
                if not raw.startswith(b"data: "):
                    continue
                now = time.perf_counter()
                data = raw[len(b"data: ") :].rstrip(b"\r\n")
                if data == b"[DONE]":
                    # Read the body's end too: a response left unread closes its connection.
                    await r.content.read()
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    raise StrataError(f"{what}: the server sent a non-JSON event") from None
                try:
                    if "error" in event:
                        error = event["error"]
                        message = error.get("message") if isinstance(error, dict) else error
                        raise StrataError(f"{what}: the server failed: {message}")
                    usage = event.get("usage") or usage
                    for choice in event["choices"]:
                        # The finishing chunk holds the last token even when its text is empty
                        # (a held back tail that the end of the stream released as nothing).
                        if choice["text"] or choice["finish_reason"]:
                            t_first = now if t_first is None else t_first
                            t_last = now
                        texts.append(choice["text"])
                        finish = choice["finish_reason"] or finish
                except (KeyError, TypeError, AttributeError):
                    raise StrataError(
                        f"{what}: the server sent an event that is not a completion chunk: "
                        f"{data[:200].decode(errors='replace')}"
                    ) from None
        except (LineTooLong, ValueError):  # older aiohttp: ValueError("Chunk too big")
            raise StrataError(
                f"{what}: the server sent a stream line over {STREAM_LINE_BYTES} bytes"
            ) from None
    if finish is None or t_first is None or t_last is None:
        raise StrataError(f"{what}: the stream ended without a finish reason")
    details = usage.get("prompt_tokens_details") or {}
    return RequestResult(
        prompt=index,
        text="".join(texts),
        finish_reason=finish,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens", 0)),
        t_sent=t_sent,
        t_first=t_first,
        t_last=t_last,
    )


def _error_message(raw: bytes) -> str:
    """The message of an OpenAI error object, else the start of the body."""
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:200]


async def reset_prefix_cache(client: aiohttp.ClientSession) -> None:
    """``POST /reset_prefix_cache``: empty the server's prefix cache (no request may be running).

    Raises:
        StrataError: the server refused (HTTP 409 while requests run) or failed.
    """
    async with client.post("/reset_prefix_cache") as r:
        status, raw = r.status, await r.read()
    if status != 200:
        raise StrataError(f"resetting the prefix cache: HTTP {status}: {_error_message(raw)}")


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` of a Prometheus text exposition (comments skipped)."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


async def _metrics(client: aiohttp.ClientSession) -> dict[str, float]:
    async with client.get("/metrics") as r:
        status, raw = r.status, await r.read()
    return parse_metrics(raw.decode(errors="replace")) if status == 200 else {}


COUNTERS = {
    "prefix_hit_tokens": "strata_prefix_cache_hits_total",
    "prefix_query_tokens": "strata_prefix_cache_queries_total",
    "preemptions": "strata_preemptions_total",
    "engine_steps": "strata_engine_steps_total",
    "batched_tokens": "strata_batched_tokens_total",
    "compiled_pass_traces": "strata_compiled_pass_traces_total",
    "compiled_pass_replays": "strata_compiled_pass_replays_total",
}
"""Counters reported per level as after - before, by their ``/metrics`` names."""
GAUGES = {
    "kv_blocks_peak": "strata_kv_blocks_in_use",
    "running_peak": "strata_num_requests_running",
    "waiting_peak": "strata_num_requests_waiting",
}
"""Gauges reported per level as their sampled maximum."""


SERVER_TTFT = "strata_time_to_first_token_seconds"
"""The server's TTFT histogram (submission to the engine's first token)."""


def _delta(before: dict, after: dict, name: str) -> int | None:
    if name not in before or name not in after:
        return None
    return round(after[name] - before[name])


def _hist_mean(before: dict, after: dict, name: str) -> float | None:
    n = _delta(before, after, f"{name}_count")
    if not n:
        return None
    return round((after[f"{name}_sum"] - before[f"{name}_sum"]) / n, 6)


def server_summary(before: dict, after: dict, samples: list[dict]) -> dict[str, Any]:
    """A level's server-side figures from ``/metrics`` snapshots (see the module docstring)."""
    out: dict[str, Any] = {k: _delta(before, after, n) for k, n in COUNTERS.items()}
    steps, tokens = out["engine_steps"], out["batched_tokens"]
    out["mean_batched_tokens_per_step"] = round(tokens / steps, 3) if steps else None
    out["server_ttft_mean_s"] = _hist_mean(before, after, SERVER_TTFT)
    out["server_tpot_mean_s"] = _hist_mean(before, after, "strata_time_per_output_token_seconds")
    total = after.get("strata_kv_blocks_total")
    out["kv_blocks_total"] = None if total is None else round(total)
    for key, name in GAUGES.items():  # samples taken during the level only: after it, idle
        seen = [s[name] for s in samples if name in s]
        out[key] = round(max(seen)) if seen else None
    return out


# --------------------------------------------------------------------------------------------
# A level, the prefix-cache test
# --------------------------------------------------------------------------------------------


def _session(
    url: str,
    timeout: aiohttp.ClientTimeout,
    connections: int,
    headers: dict[str, str] | None = None,
) -> aiohttp.ClientSession:
    """An aiohttp session on ``url`` with at most ``connections`` connections (kept alive);
    create it in a coroutine (aiohttp binds it to the running event loop)."""
    import aiohttp

    return aiohttp.ClientSession(
        base_url=url,
        headers=headers,
        timeout=timeout,
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=connections),
        trust_env=False,  # an HTTP(S)_PROXY from the environment must not carry loopback traffic
        read_bufsize=STREAM_LINE_BYTES // 2,  # lines up to STREAM_LINE_BYTES
    )


def _client(server: ServerProcess, connections: int) -> aiohttp.ClientSession:
    """The bench's session on ``server`` (its API key sent with every request)."""
    import aiohttp

    # aiohttp's default total timeout is 5 minutes per request, which a long queued or decoding
    # request may exceed: none here, and no read timeout (a queued request may wait long for its
    # first token; a dead server closes the connection, which ends the wait). ``connect``
    # covers the wait for a free connection of the pool and the new connection's setup.
    timeout = aiohttp.ClientTimeout(
        total=None, connect=CONNECT_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S, sock_read=None
    )
    auth = {"Authorization": f"Bearer {server.api_key}"}
    return _session(server.url, timeout, connections, auth)


def _failure(e: BaseException) -> str:
    """A failed request's exception in words (aiohttp's timeouts often carry no message)."""
    if isinstance(e, TimeoutError) and not str(e):
        return f"timed out ({e!r})"
    return repr(e)


async def _closed_loop(
    client: aiohttp.ClientSession, model: str, prompts: list[str], max_tokens: int, c: int
) -> list[RequestResult]:
    """Keep ``c`` requests in flight until every prompt's request has completed (request ``i``
    sends ``prompts[i]``); the first failure cancels the rest."""
    results: list[RequestResult | None] = [None] * len(prompts)
    todo = iter(range(len(prompts)))  # shared by the workers: each takes the next request

    async def worker() -> None:
        for i in todo:
            results[i] = await stream_completion(client, model, prompts[i], max_tokens, i)

    try:
        async with asyncio.TaskGroup() as tg:
            for _ in range(min(c, len(prompts))):
                tg.create_task(worker())
    except ExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [r for r in results if r is not None]


async def _sample_metrics(client: aiohttp.ClientSession, samples: list[dict]) -> None:
    import aiohttp

    while True:
        await asyncio.sleep(METRICS_POLL_S)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            samples.append(await _metrics(client))


async def run_level(
    server: ServerProcess,
    prompts: list[str],
    warmup_solo: list[str],
    warmup_batch: list[str],
    max_tokens: int,
    c: int,
) -> tuple[list[RequestResult], float, dict[str, Any], float]:
    """Warm up, reset the prefix cache, then run one closed-loop level.

    Args:
        server: the running server.
        prompts: the level's prompts (request ``i`` sends ``prompts[i]``).
        warmup_solo: warm-up prompts sent one at a time (one per prefill shape).
        warmup_batch: warm-up prompts sent next, all at once (the decode batch shapes).
        max_tokens: tokens each measured request generates.
        c: measured requests kept in flight.

    Returns:
        ``(results in prompt order, wall time of the level in seconds, server figures, wall time
        of the warm-up in seconds)``.
    """
    async with _client(server, c + 1) as client:
        t0 = time.perf_counter()
        await _closed_loop(client, server.model, warmup_solo, WARMUP_MAX_TOKENS, 1)
        n = len(warmup_batch)
        await _closed_loop(client, server.model, warmup_batch, WARMUP_MAX_TOKENS, n)
        warmup_s = time.perf_counter() - t0
        await reset_prefix_cache(client)
        before = await _metrics(client)
        samples: list[dict] = []
        poller = asyncio.create_task(_sample_metrics(client, samples))
        t0 = time.perf_counter()
        try:
            results = await _closed_loop(client, server.model, prompts, max_tokens, c)
        finally:
            poller.cancel()
        wall = time.perf_counter() - t0
        after = await _metrics(client)
    return results, wall, server_summary(before, after, samples), warmup_s


class PrefixTrial(NamedTuple):
    """One cold/warm pair of the prefix-cache test; the counts are ``/metrics`` deltas over
    each request (None when the server does not export the counter)."""

    cold: RequestResult
    warm: RequestResult
    cold_hit_tokens: int | None
    warm_hit_tokens: int | None
    warm_compiled_traces: int | None
    """Compiled passes traced for the warm request (``executor.pass_graph``)."""
    warm_compiled_replays: int | None
    """Compiled passes replayed for the warm request."""
    cold_server_ttft_s: float | None = None
    """The server's own TTFT of the cold request (its ``/metrics`` histogram: submission to
    the engine's first token, seconds); the client's TTFT less this is what the HTTP path
    added to the request (parsing, tokenization, delivery of the token, the client's reading)."""
    warm_server_ttft_s: float | None = None
    """The same for the warm request."""


async def run_prefix_test(
    server: ServerProcess, cold: str, warm: str, warm_up: bool = False, trials: int = 1
) -> list[PrefixTrial]:
    """``trials`` times: a prefix-cache reset, then the cold request, then the warm one, one at a
    time on an idle server. With ``warm_up`` (a GPU, whose backend builds kernels for each new
    shape), both are sent once before the first reset, so that the cold TTFT is prefill, not
    kernel building.

    Returns:
        one :class:`PrefixTrial` per trial.
    """
    name = COUNTERS["prefix_hit_tokens"]
    traces, replays = COUNTERS["compiled_pass_traces"], COUNTERS["compiled_pass_replays"]
    out = []
    async with _client(server, 2) as client:
        if warm_up:
            for text in (cold, warm):
                await stream_completion(client, server.model, text, PREFIX_MAX_TOKENS, -3)
        for _ in range(trials):
            await reset_prefix_cache(client)
            m0 = await _metrics(client)
            a = await stream_completion(client, server.model, cold, PREFIX_MAX_TOKENS, -1)
            m1 = await _metrics(client)
            b = await stream_completion(client, server.model, warm, PREFIX_MAX_TOKENS, -2)
            m2 = await _metrics(client)
            trial = PrefixTrial(
                cold=a,
                warm=b,
                cold_hit_tokens=_delta(m0, m1, name),
                warm_hit_tokens=_delta(m1, m2, name),
                warm_compiled_traces=_delta(m1, m2, traces),
                warm_compiled_replays=_delta(m1, m2, replays),
                cold_server_ttft_s=_hist_mean(m0, m1, SERVER_TTFT),
                warm_server_ttft_s=_hist_mean(m1, m2, SERVER_TTFT),
            )
            out.append(trial)
    return out


# --------------------------------------------------------------------------------------------
# The bench
# --------------------------------------------------------------------------------------------


def _stats(values: list[float | None], digits: int = 6) -> dict[str, float | None]:
    import numpy as np

    v = [x for x in values if x is not None]
    if not v:
        return {"p50": None, "p99": None, "mean": None, "min": None, "max": None}
    p50, p99 = np.percentile(v, [50, 99])
    return {
        "p50": round(float(p50), digits),
        "p99": round(float(p99), digits),
        "mean": round(sum(v) / len(v), digits),
        "min": round(min(v), digits),
        "max": round(max(v), digits),
    }


def _first_difference(a: Sequence, b: Sequence) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length when one is a prefix)."""
    pairs = zip(a, b, strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


def machine_info() -> dict[str, Any]:
    """This machine: OS, CPU count, RAM (bytes), MLX's version, device and device info."""
    import mlx.core as mx
    import psutil

    try:
        info = {
            k: v if isinstance(v, int | float | str) else str(v)
            for k, v in mx.device_info().items()
        }
    except (AttributeError, RuntimeError):
        info = None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "mlx_version": mx.__version__,
        "mlx_device": str(mx.default_device()),
        "mlx_device_info": info,
    }


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while the bench runs, so the server is stopped too."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _check_room(name: str, need: int, context: int, pool_tokens: int, fix: str) -> None:
    """Raises StrataError when ``need`` tokens do not fit one sequence of the plan."""
    if need > context:
        raise StrataError(
            f"{name} needs {need} tokens per sequence but the plan's context is {context} "
            f"tokens; re-plan with a larger --context (strata plan ... --context {need}), or "
            f"{fix}"
        )
    if need > pool_tokens:
        raise StrataError(
            f"{name} needs {need} tokens per sequence but the plan's KV cache holds "
            f"{pool_tokens}; re-plan with more memory for the KV cache, or {fix}"
        )


@dataclass
class Workload:
    """What the bench sends, made before any server starts.

    Attributes:
        prompts: ``(text, tokens)`` of prompt ``i`` (request ``i`` of every level).
        warmup: warm-up prompts (one per request of the largest warm-up).
        prefix: the prefix-cache test's ``cold`` and ``warm`` prompts, ``doc_tokens`` (the shared
            document) and ``shared`` (tokens the two prompts share), or None to skip it.
    """

    prompts: list[tuple[str, int]]
    warmup: list[str]
    prefix: dict[str, Any] | None


def make_workload(
    tok: GGUFTokenizer,
    batch,
    context: int,
    n_prompts: int,
    n_warmup: int,
    max_tokens: int,
    prefix_tokens: int,
    prompt_tokens: Sequence[int] = PROMPT_TOKENS,
) -> Workload:
    """The prompts, checked against the plan's context and KV cache (``batch``: its limits;
    ``prompt_tokens``: prompt lengths, cycled).

    Raises:
        StrataError: ``max_tokens`` or the prefix-cache test does not fit one sequence of the
            plan, or ``prefix_tokens`` is below one KV block.
    """
    pool_tokens = batch.kv_num_blocks * batch.kv_block_size
    _check_room(
        f"--max-tokens {max_tokens} with a prompt of at least {MIN_PROMPT_TOKENS} tokens",
        max_tokens + MIN_PROMPT_TOKENS,
        context,
        pool_tokens,
        "lower --max-tokens",
    )
    room = min(context, pool_tokens) - max_tokens  # the longest prompt that fits
    prompts = [
        make_text(tok, f"prompt-{i}", min(prompt_tokens[i % len(prompt_tokens)], room))
        for i in range(n_prompts)
    ]
    warmup = [
        make_text(tok, f"warmup-{j}", min(WARMUP_PROMPT_TOKENS, room))[0] for j in range(n_warmup)
    ]
    if not prefix_tokens:
        return Workload(prompts, warmup, None)
    if prefix_tokens < batch.kv_block_size:
        raise StrataError(
            f"--prefix-tokens {prefix_tokens} is below the plan's KV block size "
            f"({batch.kv_block_size} tokens): no full block could be cached; give at least "
            f"{batch.kv_block_size}, or 0 to skip the prefix-cache test"
        )
    doc, _ = make_text(tok, "prefix-document", prefix_tokens)
    cold = doc + " " + make_text(tok, "prefix-suffix-a", PREFIX_SUFFIX_TOKENS)[0]
    warm = doc + " " + make_text(tok, "prefix-suffix-b", PREFIX_SUFFIX_TOKENS)[0]
    ids = [tok.encode(t) for t in (doc, cold, warm)]
    _check_room(
        f"--prefix-tokens {prefix_tokens}",
        max(len(ids[1]), len(ids[2])) + PREFIX_MAX_TOKENS,
        context,
        pool_tokens,
        "lower --prefix-tokens (0 skips the prefix-cache test)",
    )
    shared = _first_difference(ids[1], ids[2])
    return Workload(
        prompts, warmup, {"cold": cold, "warm": warm, "doc_tokens": len(ids[0]), "shared": shared}
    )


def _on_server(srv: ServerProcess, what: str, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` against ``srv``; a failure becomes a StrataError naming ``what`` and quoting
    the server's stderr."""
    import aiohttp

    try:
        return asyncio.run(coro)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise srv.failed(f"{what}: the request failed ({_failure(e)})") from None
    except StrataError as e:
        raise srv.failed(f"{what}: {e}") from None


NEAR_TIE_GAP = 0.5
"""Default largest top-2 logit gap at which a text that left its concurrency-1 text counts as a
near-tie flip, not an error (the correctness rule's, for real models): outside
``--batch-invariant`` a row's rounding on MLX's CUDA backend depends on the step's row count,
which may flip a near-tie and so every later token (measured on the H200)."""

NEAR_TIE_GAP_RANDOM = 1.0
"""The default for a random-weight synthetic model (the correctness rule's, for them): their
logits are near-ties almost everywhere."""


def default_near_tie_gap(gguf) -> float:
    """``NEAR_TIE_GAP_RANDOM`` for a random-weight synthetic GGUF (``general.name`` says "random
    weights", as ``synth.py`` and the tests' factory write it), else ``NEAR_TIE_GAP``."""
    name = gguf.field("general.name") or ""
    return NEAR_TIE_GAP_RANDOM if "random weights" in str(name) else NEAR_TIE_GAP


async def reference_logprobs(
    client: aiohttp.ClientSession, model: str, prompt: str, max_tokens: int
) -> tuple[str, list[int], list[dict[int, float]]]:
    """One greedy ``/v1/completions`` request, alone, with ``logprobs: 2`` and token ids
    (``return_tokens_as_token_ids``): its text, token ids and each token's top-2 log-probs.

    Raises:
        StrataError: an HTTP error, or a reply without logprobs.
    """
    body = {**_greedy_body(model, prompt, max_tokens), "logprobs": 2}
    body["return_tokens_as_token_ids"] = True
    async with client.post("/v1/completions", json=body) as r:
        status, raw = r.status, await r.read()
    if status != 200:
        raise StrataError(f"logprobs request: HTTP {status}: {_error_message(raw)}")
    try:
        choice = json.loads(raw)["choices"][0]
        lp = choice.get("logprobs")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise StrataError("logprobs request: the reply is not a completion") from None
    if not lp:
        raise StrataError("logprobs request: the server sent no logprobs")

    def token_id(name: str) -> int:
        return int(name.removeprefix("token_id:"))

    ids = [token_id(t) for t in lp["tokens"]]
    tops = [{token_id(k): v for k, v in top.items()} for top in lp["top_logprobs"]]
    return choice["text"], ids, tops


def classify_divergence(
    tok, ids: list[int], tops: list[dict[int, float]], got: str, gap_limit: float
) -> dict[str, Any]:
    """Where and why ``got`` left the reference text of ``ids`` (greedy, with each token's top-2
    log-probs ``tops``): the first reference token whose text ``got`` does not continue (the
    first token of its UTF-8 character, when one spans tokens), the top-2 gap there, and
    whether ``got`` continues with the runner-up instead. A near-tie flip: the runner-up was
    taken and the gap is below ``gap_limit``.

    Returns:
        ``{"token_index", "reference_token", "runner_up", "gap", "runner_up_taken",
        "near_tie"}`` (token_index None when ``got`` continues the whole reference).
    """

    def text_of(prefix: list[int]) -> str:
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return utf8.decode(b"".join(tok.token_bytes(t) for t in prefix))  # no partial tail

    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, group, at = "", 0, None
    for i, t in enumerate(ids):
        if not utf8.getstate()[0]:
            group = i  # a character boundary before token i
        text += utf8.decode(tok.token_bytes(t))
        if not got.startswith(text):
            at = i
            break
    if at is None:
        return {"token_index": None, "near_tie": False}
    found = None
    for k in range(group, at + 1):  # the tokens of the character where the texts part
        ranked = sorted(tops[k].items(), key=lambda kv: (-kv[1], kv[0]))
        runner = next((t for t, _ in ranked if t != ids[k]), None)
        gap = ranked[0][1] - ranked[1][1] if len(ranked) > 1 else math.inf
        taken = runner is not None and got.startswith(text_of([*ids[:k], runner]))
        found = {
            "token_index": k,
            "reference_token": ids[k],
            "runner_up": runner,
            "gap": round(gap, 4) if math.isfinite(gap) else None,
            "runner_up_taken": taken,
            "near_tie": taken and gap < gap_limit,
        }
        if taken:
            break
    assert found is not None
    return found


async def classify_mismatches(
    server: ServerProcess,
    bad: list[dict],
    prompts: list[str],
    max_tokens: int,
    tok,
    refs: dict[int, tuple],
    gap_limit: float,
) -> None:
    """Add ``classify_divergence``'s fields to each mismatch of ``bad`` (in place), asking the
    idle server for each prompt's reference logprobs once (cached in ``refs``), each after a
    prefix-cache reset, so that its prompt is prefilled as at concurrency 1 (a cached prefix
    would leave a shorter prefill, whose products can take another kernel path and round
    differently on a GPU). A reference whose text is not the concurrency-1 text
    (``reference_reproduced`` false) is no near-tie."""
    async with _client(server, 1) as client:
        for m in bad:
            p = m["prompt"]
            if p not in refs:
                await reset_prefix_cache(client)
                refs[p] = await reference_logprobs(client, server.model, prompts[p], max_tokens)
            text, ids, tops = refs[p]
            if text != m["expected"]:
                m.update(token_index=None, near_tie=False, reference_reproduced=False)
                continue
            m.update(classify_divergence(tok, ids, tops, m["got"], gap_limit))
            m["reference_reproduced"] = True


def _mismatches(c: int, results: list[RequestResult], reference: list[str]) -> list[dict]:
    """Requests whose text differs from the same prompt's at concurrency 1."""
    return [
        {
            "concurrency": c,
            "prompt": r.prompt,
            "first_difference": _first_difference(reference[r.prompt], r.text),
            "expected": reference[r.prompt],
            "got": r.text,
        }
        for r in results
        if r.text != reference[r.prompt]
    ]


def http_bench(
    plan_path: str | Path,
    concurrency: list[int],
    max_tokens: int,
    requests: int | None = None,
    prefix_tokens: int = PREFIX_TOKENS,
    prompt_tokens: Sequence[int] = PROMPT_TOKENS,
    log: TextIO | None = None,
    batch_invariant: bool = False,
    near_tie_gap: float | None = None,
    prefix_trials: int | None = None,
) -> dict[str, Any]:
    """Run the serving bench and return its JSON-ready result (schema: the module docstring).

    Args:
        plan_path: the plan to serve.
        concurrency: concurrency levels (``parse_concurrency``); 1 is added when absent.
        max_tokens: tokens every request generates (>= 2).
        requests: requests per level (``requests_per_level``); None for the default.
        prefix_tokens: tokens of the shared document of the prefix-cache test; 0 skips it.
        prompt_tokens: prompt lengths (tokens), cycled over the requests.
        log: where progress lines go (default stderr).
        batch_invariant: serve with ``--batch-invariant``.
        near_tie_gap: a text that leaves its concurrency-1 text by a near-tie flip with a top-2
            gap below this passes (``classify_divergence``); 0: every difference fails; None:
            ``default_near_tie_gap`` of the plan's model.
        prefix_trials: cold/warm pairs of the prefix-cache test; None: ``PREFIX_TRIALS`` on a
            GPU, 1 on the CPU.

    Raises:
        StrataError: a bad plan; prompts or a prefix that do not fit the plan's context; a
            server that does not start; a failed request, or one that did not generate
            ``max_tokens`` tokens.
    """
    from strata.executor.plan_loader import load_plan
    from strata.executor.tokenizer import GGUFTokenizer

    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise StrataError("the serving bench needs aiohttp: pip install 'aiohttp>=3.9'") from None
    log = log or sys.stderr
    if max_tokens < 2:
        raise StrataError("--max-tokens must be at least 2 for a decode measurement")
    if prefix_tokens < 0:
        raise StrataError(f"--prefix-tokens {prefix_tokens}: give a token count, or 0 to skip")
    if prefix_trials is not None and prefix_trials < 1:
        raise StrataError(f"--prefix-trials {prefix_trials}: give at least 1 cold/warm pair")
    if prefix_trials is not None and not prefix_tokens:
        raise StrataError(
            "--prefix-trials applies to the prefix-cache test: drop it, or give "
            "--prefix-tokens above 0"
        )
    levels = sorted({1, *concurrency})
    per_level = requests_per_level(levels, requests)
    if near_tie_gap is not None and near_tie_gap < 0:
        raise StrataError(f"--near-tie-gap {near_tie_gap}: give a logit gap >= 0")
    loaded = load_plan(plan_path)  # a stale or broken plan fails here, before any server starts
    if batch_invariant:
        near_tie_gap = 0.0  # the mode's promise is equal texts: no flip passes
    elif near_tie_gap is None:
        near_tie_gap = default_near_tie_gap(loaded.gguf)
    plan = loaded.plan
    batch = plan.batch
    tok = GGUFTokenizer.from_gguf(loaded.gguf)
    work = make_workload(
        tok,
        batch,
        plan.request.context,
        max(per_level.values()),
        min(max(levels), batch.max_num_seqs),
        max_tokens,
        prefix_tokens,
        prompt_tokens,
    )
    result: dict[str, Any] = {
        "kind": "serving",
        "plan": str(plan_path),
        "model": None,
        "batch_invariant": batch_invariant,
        "machine": machine_info(),
        "plan_limits": {
            "context": plan.request.context,
            "objective": plan.request.objective,
            "concurrency": plan.request.concurrency,
            "predicted_decode_tok_s": plan.prediction.decode_tok_s if plan.prediction else None,
            "batch": batch.model_dump(),
        },
        "settings": {
            "concurrency": levels,
            "added_level_1": 1 not in concurrency,
            "max_tokens": max_tokens,
            "requests": {str(c): n for c, n in per_level.items()},
            "prefix_tokens": prefix_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "server_per_level": False,
            "prompt_lengths": list(prompt_tokens),
            "prompt_tokens": [n for _, n in work.prompts],
        },
        "levels": [],
        "scaling": {},
        "texts": [],
        "prefix_cache": None,
        "mismatches": [],
        "near_tie_gap": near_tie_gap,
    }
    if 1 not in concurrency:
        print("bench: added concurrency 1 (the text reference and the scaling base)", file=log)
    key = secrets.token_hex(16)
    with (
        _sigterm_as_interrupt(),
        ServerProcess(
            ServerProcess.serve_command(Path(plan_path), key, batch_invariant), key
        ) as srv,
    ):
        result["model"] = srv.model
        assert srv.proc is not None
        print(f"bench: server up (pid {srv.proc.pid}, {srv.url})", file=log, flush=True)
        warmed: set[int] = set()  # prompt token counts prefilled on this server
        refs: dict[int, tuple] = {}  # prompt -> its reference_logprobs, when a text differed
        for c in levels:
            print(
                f"bench: concurrency {c}: {per_level[c]} requests of {max_tokens} tokens",
                file=log,
                flush=True,
            )
            level_prompts = work.prompts[: per_level[c]]
            solo: dict[int, str] = {}  # one prompt per new token count: every prefill shape
            for text, n in level_prompts:
                if n not in warmed:
                    solo.setdefault(n, text)
            warmed |= solo.keys()
            # Level 1's decode batch (one sequence) is warmed by the solo requests already.
            warmup = work.warmup[: min(c, batch.max_num_seqs)] if c > 1 else []
            texts = [t for t, _ in level_prompts]
            run = run_level(srv, texts, [*solo.values()], warmup, max_tokens, c)
            results, wall, server, warmup_s = _on_server(srv, f"concurrency {c}", run)
            level = _level_result(c, batch.max_num_seqs, results, wall, server, max_tokens)
            level["warmup"] = {
                "requests": len(solo) + len(warmup),
                "prompt_tokens": [*solo],
                "concurrent": len(warmup),
                "max_tokens": WARMUP_MAX_TOKENS,
                "wall_s": round(warmup_s, 6),
            }
            if c == 1:
                result["texts"] = [r.text for r in results]
            base = result["levels"][0]["aggregate_tok_s"] if result["levels"] else None
            level["vs_level_1"] = round(level["aggregate_tok_s"] / base, 3) if base else 1.0
            bad = _mismatches(c, results, result["texts"])
            if bad:
                texts = [t for t, _ in work.prompts]
                check = classify_mismatches(srv, bad, texts, max_tokens, tok, refs, near_tie_gap)
                _on_server(srv, f"concurrency {c}: the near-tie check", check)
            level["check_passed"] = all(m["near_tie"] for m in bad)
            level["mismatched_prompts"] = [m["prompt"] for m in bad]
            level["near_tie_flips"] = sum(m["near_tie"] for m in bad)
            result["mismatches"] += bad
            result["scaling"][str(c)] = level["vs_level_1"]
            result["levels"].append(_ordered(level))
            print(_level_line(level), file=log, flush=True)
        if work.prefix is not None:
            p = work.prefix
            gpu = "cpu" not in result["machine"]["mlx_device"]
            pairs = prefix_trials or (PREFIX_TRIALS if gpu else 1)
            trials = _on_server(
                srv, "prefix-cache test", run_prefix_test(srv, p["cold"], p["warm"], gpu, pairs)
            )
            result["prefix_cache"] = _prefix_result(
                p, trials, batch.kv_block_size, lends=not batch_invariant
            )
            print(_prefix_line(result["prefix_cache"]), file=log, flush=True)
    prefix_ok = result["prefix_cache"] is None or result["prefix_cache"]["check_passed"]
    result["check_passed"] = all(lv["check_passed"] for lv in result["levels"]) and prefix_ok
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return result


def _level_result(
    c: int,
    max_num_seqs: int,
    results: list[RequestResult],
    wall: float,
    server: dict,
    max_tokens: int,
) -> dict[str, Any]:
    """One level's figures; a request that did not generate exactly ``max_tokens`` tokens
    (``ignore_eos`` not honoured) raises StrataError: the figures would be wrong."""
    for r in results:
        if r.completion_tokens != max_tokens or r.finish_reason != "length":
            raise StrataError(
                f"concurrency {c}, prompt {r.prompt}: the server generated {r.completion_tokens} "
                f"tokens (finish reason {r.finish_reason}) instead of max_tokens {max_tokens} "
                "despite ignore_eos; the bench's figures would be wrong"
            )
    tokens = sum(r.completion_tokens for r in results)
    note = queue_note(c, max_num_seqs)
    return {
        "concurrency": c,
        "requests": len(results),
        "queued": note is not None,
        **({"note": note} if note else {}),
        "wall_s": round(wall, 6),
        "completion_tokens": tokens,
        "aggregate_tok_s": round(tokens / wall, 3),
        "ttft_s": _stats([r.ttft_s for r in results]),
        "tpot_s": _stats([r.tpot_s for r in results]),
        "request_decode_tok_s": _stats([r.decode_tok_s for r in results], 3),
        "server": server,
        "per_request": [
            {
                "prompt": r.prompt,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "cached_tokens": r.cached_tokens,
                "ttft_s": round(r.ttft_s, 6),
                "tpot_s": None if r.tpot_s is None else round(r.tpot_s, 6),
                "decode_tok_s": None if r.decode_tok_s is None else round(r.decode_tok_s, 3),
                "finish_reason": r.finish_reason,
            }
            for r in results
        ],
    }


_LEVEL_KEYS = (
    "concurrency requests queued note wall_s completion_tokens aggregate_tok_s vs_level_1 ttft_s "
    "tpot_s request_decode_tok_s server warmup check_passed mismatched_prompts per_request"
).split()


def _ordered(level: dict) -> dict:
    """The level's keys in the documented order (stable JSON for diffs)."""
    return {k: level[k] for k in _LEVEL_KEYS if k in level}


def _prefix_result(
    prefix: dict,
    trials: list[PrefixTrial],
    bs: int,
    lends: bool = True,
) -> dict[str, Any]:
    """The prefix-cache test's figures (``bs``: the KV block size, tokens; ``lends``: the server
    lends partial blocks, as all but batch-invariant ones do): the TTFTs are the medians over
    the trials, each trial's are listed."""
    import numpy as np
    from strata.executor.block_pool import lend_min_tokens

    a, b = trials[0].cold, trials[0].warm
    # The scheduler matches at most len(prompt) - 1 tokens (the last token is always computed):
    # whole blocks, then the rest where that is enough to lend the cold prompt's block, which
    # is registered only if the cold prompt filled it (its one output token is not computed).
    shared = min(prefix["shared"], b.prompt_tokens - 1)
    expected, rest = shared // bs * bs, shared % bs
    if lends and rest >= lend_min_tokens(bs) and a.prompt_tokens >= expected + bs:
        expected += rest
    cold = float(np.median([t.cold.ttft_s for t in trials]))
    warm = float(np.median([t.warm.ttft_s for t in trials]))
    hits_warm = [t.warm_hit_tokens for t in trials]
    return {
        "prefix_tokens": prefix["doc_tokens"],
        "cold_prompt_tokens": a.prompt_tokens,
        "warm_prompt_tokens": b.prompt_tokens,
        "shared_prefix_tokens": prefix["shared"],
        "expected_hit_tokens": expected,
        "cold_ttft_s": round(cold, 6),
        "warm_ttft_s": round(warm, 6),
        "warm_over_cold": round(warm / cold, 4) if cold > 0 else None,
        "cold_server_ttft_s": _stats([t.cold_server_ttft_s for t in trials])["p50"],
        "warm_server_ttft_s": _stats([t.warm_server_ttft_s for t in trials])["p50"],
        "cold_hit_tokens": trials[0].cold_hit_tokens,
        "warm_hit_tokens": hits_warm[0],
        "warm_cached_tokens": b.cached_tokens,
        "trials": [
            {
                "cold_ttft_s": round(t.cold.ttft_s, 6),
                "warm_ttft_s": round(t.warm.ttft_s, 6),
                "cold_hit_tokens": t.cold_hit_tokens,
                "warm_hit_tokens": t.warm_hit_tokens,
                "warm_compiled_traces": t.warm_compiled_traces,
                "warm_compiled_replays": t.warm_compiled_replays,
                "cold_server_ttft_s": t.cold_server_ttft_s,
                "warm_server_ttft_s": t.warm_server_ttft_s,
            }
            for t in trials
        ],
        "check_passed": all(h and h > 0 for h in hits_warm),
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms" if x < 0.1 else f"{x * 1000:.0f} ms"


def _peak(value: int | None) -> str:
    """A sampled peak as the log line gives it."""
    return f"not sampled (level under {METRICS_POLL_S} s)" if value is None else str(value)


def _level_line(lv: dict) -> str:
    """The log line of one concurrency level's result."""
    s, ttft, tpot = lv["server"], lv["ttft_s"], lv["tpot_s"]
    return (
        f"bench: concurrency {lv['concurrency']}: {lv['requests']} requests, "
        f"{lv['aggregate_tok_s']:.2f} tok/s aggregate (x{lv['vs_level_1']:.2f} level 1), "
        f"TTFT p50 {_ms(ttft['p50'])} p99 {_ms(ttft['p99'])}, "
        f"TPOT p50 {_ms(tpot['p50'])} p99 {_ms(tpot['p99'])}, "
        f"KV blocks peak {_peak(s['kv_blocks_peak'])}/{s['kv_blocks_total']}, "
        f"preemptions {s['preemptions']}, warm-up {lv['warmup']['wall_s']:.1f} s, "
        f"texts {_texts_verdict(lv)}" + (" (queued: above max_num_seqs)" if lv["queued"] else "")
    )


def _texts_verdict(lv: dict) -> str:
    flips, differ = lv["near_tie_flips"], len(lv["mismatched_prompts"])
    if not differ:
        return "equal"
    if lv["check_passed"]:
        return f"equal but for {flips} near-tie flips"
    return f"DIFFER ({differ - flips} not at a near-tie, {flips} near-tie flips)"


def _cut(cold: float | None, warm: float | None) -> str:
    """How many times shorter the warm TTFT is than the cold one (``4.42x``), or ``-``."""
    return f"{cold / warm:.2f}x" if cold and warm else "-"


def _prefix_line(p: dict) -> str:
    """The log line of the prefix-cache test's result."""
    cold_s, warm_s = p["cold_server_ttft_s"], p["warm_server_ttft_s"]
    return (
        f"bench: prefix cache: {p['prefix_tokens']}-token prefix, TTFT cold "
        f"{_ms(p['cold_ttft_s'])}, warm {_ms(p['warm_ttft_s'])} (cut "
        f"{_cut(p['cold_ttft_s'], p['warm_ttft_s'])}; in the server: cold {_ms(cold_s)}, warm "
        f"{_ms(warm_s)}, cut {_cut(cold_s, warm_s)}), "
        f"{p['warm_hit_tokens']} hit tokens" + ("" if p["check_passed"] else " — NO HIT")
    )


# --------------------------------------------------------------------------------------------
# Plot, command
# --------------------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    """A figure (PNG, SVG or PDF by ``path``'s suffix; Agg backend): aggregate decode tok/s vs
    concurrency (with linear scaling from level 1 for reference), and TTFT and TPOT p50/p99 (ms)
    vs concurrency; a dotted line marks the plan's ``max_num_seqs``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    cs = [lv["concurrency"] for lv in levels]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
    tok_s = [lv["aggregate_tok_s"] for lv in levels]
    a.plot(cs, tok_s, "o-", color="#2a7", label="measured")
    if tok_s:
        a.plot(cs, [tok_s[0] * x for x in cs], ":", color="#999", label="linear from c=1")
    a.set_title("aggregate decode tok/s")
    a.set_ylim(bottom=0)
    for ax, key, title in ((b, "ttft_s", "TTFT (ms)"), (c, "tpot_s", "TPOT (ms)")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [lv[key][q] * 1000 if lv[key][q] is not None else float("nan") for lv in levels]
            ax.plot(cs, ys, style, label=q)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
    max_seqs = result["plan_limits"]["batch"]["max_num_seqs"]
    for ax in (a, b, c):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(x) for x in cs])
        ax.set_xlabel("concurrency")
        if max_seqs <= max(cs):
            label = f"max_num_seqs {max_seqs}" if ax is a else None
            ax.axvline(max_seqs, color="#c33", linestyle=":", linewidth=1, label=label)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    title = f"{result['model']} — {Path(result['plan']).name} — {result['machine']['mlx_device']}"
    p = result.get("prefix_cache")
    if p:
        title += (
            f" — prefix cache TTFT {p['cold_ttft_s'] * 1000:.0f} → {p['warm_ttft_s'] * 1000:.0f} ms"
        )
    if not result["check_passed"]:
        title += " — CHECK FAILED"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def refuse_serving_options(args: argparse.Namespace) -> None:
    """Refuse the serving bench's options in a single-stream bench (no ``--concurrency``).

    Raises:
        StrataError: ``--requests``, ``--prefix-tokens``, ``--prefix-trials``,
            ``--prompt-tokens``, ``--batch-invariant`` or ``--near-tie-gap`` was given.
    """
    options = ("requests", "prefix_tokens", "prefix_trials", "prompt_tokens", "batch_invariant")
    for option in (*options, "near_tie_gap"):
        if getattr(args, option, None) not in (None, False):
            name = "--" + option.replace("_", "-")
            raise StrataError(
                f"{name} applies to the serving bench; add --concurrency (e.g. 1,2,4), or drop it"
            )


def cmd_http_bench(args: argparse.Namespace) -> None:
    """``strata bench PLAN --concurrency ...``: run, write the JSON (``-o`` or stdout) and
    the plot, then fail if a check failed.

    Raises:
        StrataError: bad arguments, a failed run, or a failed check (after the outputs are
            written).
    """
    levels = parse_concurrency(args.concurrency)
    if args.expert_cache_modes:
        raise StrataError(
            "--expert-cache-modes applies to the single-stream bench; drop it or --concurrency"
        )
    if args.check != "resident":
        raise StrataError(
            "--check applies to the single-stream bench; with --concurrency every text is "
            "checked against concurrency 1"
        )
    if args.requests is not None and args.requests < 1:
        raise StrataError(f"--requests {args.requests}: give at least 1 request per level")
    lengths = PROMPT_TOKENS
    if args.prompt_tokens is not None:
        lengths = tuple(parse_positive_ints("--prompt-tokens", args.prompt_tokens, "64,256"))
    prefix = PREFIX_TOKENS if args.prefix_tokens is None else args.prefix_tokens
    result = http_bench(
        args.plan,
        levels,
        args.max_tokens,
        args.requests,
        prefix,
        lengths,
        batch_invariant=args.batch_invariant,
        near_tie_gap=args.near_tie_gap,
        prefix_trials=args.prefix_trials,
    )
    from strata.benchmarks.bench import write_result

    write_result(result, args.output, args.plot, plot)
    if not result["check_passed"]:
        failed = [m for m in result["mismatches"] if not m["near_tie"]]
        where = [f"c={m['concurrency']} prompt {m['prompt']}" for m in failed[:5]]
        if result["prefix_cache"] and not result["prefix_cache"]["check_passed"]:
            where.append("no prefix-cache hit on the warm request")
        raise StrataError(
            "bench check failed: " + "; ".join(where) + f" ({len(failed)} text mismatches "
            "against concurrency 1 not at a near-tie; the JSON lists them)"
        )
