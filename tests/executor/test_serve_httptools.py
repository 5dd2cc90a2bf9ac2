"""``strata serve`` needs httptools (a pinned dependency): uvicorn's h11 fallback has no request
head timeout, so a server without httptools would lose its slow-client guard; it refuses to start
instead, with one line naming the fix, before it binds the port or loads the plan."""

from __future__ import annotations

import sys

import pytest
from strata.common.errors import StrataError
from strata.executor.server import app


def _without_httptools(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "httptools", None)  # import httptools: ImportError
    monkeypatch.delitem(sys.modules, "uvicorn.protocols.http.httptools_impl", raising=False)


def test_serve_refuses_to_start_without_httptools(monkeypatch, tmp_path):
    _without_httptools(monkeypatch)
    with pytest.raises(StrataError) as e:
        app.serve(tmp_path / "no-such-plan.yaml", port=0)  # a plan error would come later
    assert str(e.value) == app.HTTPTOOLS_MISSING
    assert "bash scripts/setup.sh" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(StrataError, match="httptools is missing"):
        app._guarded_protocol(5.0)  # no h11 fallback below serve either


def test_with_httptools_the_guarded_protocol_is_uvicorn_s():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    app.require_httptools()
    assert issubclass(app._guarded_protocol(5.0), HttpToolsProtocol)
