"""The OpenAI-compatible HTTP server over the serving engine (``strata serve``)."""

from strata.executor.server.app import create_app, serve

__all__ = ["create_app", "serve"]
