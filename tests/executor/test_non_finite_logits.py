"""NaN or infinite logits end the request with a clear error naming the step (issue 35: a
broken model emitted token 0 forever, exit 0)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_plan_file
from gguf_bytes import read_parts, write_parts
from gguf_factory import write_tiny_llama
from strata.common.errors import StrataError
from strata.executor.engine import Engine
from strata.executor.generate import generate
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine


@pytest.fixture(scope="module")
def nan_plan(tmp_path_factory):
    """The plan of a tiny Llama whose final norm weights are NaN."""
    d = tmp_path_factory.mktemp("nan")
    parts = read_parts(write_tiny_llama(d / "ok.gguf"))
    norm = next(t for t in parts.tensors if t.name == "output_norm.weight")
    nan = np.full(len(norm.data) // 4, np.nan, np.float32).tobytes()
    model = write_parts(d / "nan.gguf", parts.tensor(norm.name, data=nan))
    return make_plan_file(str(model), d / "p.yaml", context=32)


def test_run_ends_with_one_error_line(nan_plan):
    """``strata run`` on it: status 2 and one ``error:`` line naming the step, not token 0."""
    from test_cli import assert_one_line_error, cli

    done = cli("-m", "strata", "run", str(nan_plan), "--prompt-ids", "1,2,3", ok=False)
    assert_one_line_error(done, "NaN or infinite logits", "prefill")
    assert done.stdout == ""


@pytest.fixture(scope="module")
def nan_serving(nan_plan):
    """A started serving engine of that model."""
    se = ServingEngine(Engine(load_plan(nan_plan)))
    se.start()
    yield se
    se.close()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_weights_stop_the_request_naming_the_step(nan_serving, temperature):
    """Greedy (checked on the device with the argmax) and sampled (checked on the host)."""
    params = SamplingParams(temperature=temperature, seed=1)
    with pytest.raises(StrataError, match="NaN or infinite logits at the prompt's prefill") as e:
        generate(nan_serving, [1, 2, 3], params, 4, stop_at_eog=False)
    assert "\n" not in str(e.value)
    # The engine stays usable: the next request fails the same way, not with a stale state.
    with pytest.raises(StrataError, match="position 2"):
        generate(nan_serving, [4, 5, 6], params, 4, stop_at_eog=False)


def test_serve_answers_the_request_with_an_error(nan_serving):
    """Over HTTP: a 500 naming the step, and the server keeps answering."""
    from starlette.testclient import TestClient
    from strata.executor.server import create_app

    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}
    with TestClient(create_app(nan_serving, "m"), raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500
        assert "NaN or infinite logits at the prompt's prefill" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 200
