"""An OpenAI-compatible HTTP API over the serving engine (``strata serve``, ``strata serve``).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as server-sent events
or not), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text format). The
request and response shapes are OpenAI's, so the official clients work unchanged; ``top_k`` and
``ignore_eos`` are extensions, as in vLLM. ``POST /reset_prefix_cache`` (vLLM's route, with the
API key when one is set) empties the prefix cache between benchmark runs: 200 ``{"reset": true}``,
or 409 while requests are running or waiting.

One module per role, each importing only those above it in this list:

- ``protocol``: the request bodies, their validation, and the OpenAI error object;
- ``logprobs``: OpenAI's ``logprobs`` objects; ``metrics``: the Prometheus counters;
  ``stop``: stop-string matching;
- ``generation``: one request's path from the engine thread to its response, and the handlers'
  shared state (threads, back-pressure, disconnects);
- ``access_log``: one line per request on stderr (the middleware, and the hooks ``streaming``
  calls);
- ``streaming``: a generation sent as server-sent events, or collected whole;
- ``routes``: the route handlers; ``app``: the application and ``serve`` (shutdown).
"""

from strata.executor.server.app import create_app, serve

__all__ = ["create_app", "serve"]
