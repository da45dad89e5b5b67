"""Property-based fuzzing of `specee serve` from its own OpenAPI schema (schemathesis, valid and
invalid bodies): the server never answers 5xx, every error has the OpenAI shape, and the engine
thread keeps serving afterwards."""
from __future__ import annotations

import pytest
from conftest import real_model_dir

pytest.importorskip("fastapi", reason="the server extra (pip install 'specee[server]') is not installed")
schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (requirements-ci.txt)")

from hypothesis import HealthCheck, settings  # noqa: E402
from server_helpers import LiveServer  # noqa: E402

from specee import LLM  # noqa: E402
from specee.server import create_app  # noqa: E402

# Generated bodies ask for up to the whole context (stories260K: 512 tokens) and 16 choices: the cap
# keeps the run short, as a server operator's --max-num-seqs would.
EXAMPLES = 25


@pytest.fixture(scope="module")
def live():
    llm = LLM(real_model_dir("stories260K"), dtype="float32", max_num_seqs=16)
    server = LiveServer(create_app(llm, model_name="stories"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(live):
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    schema.config.generation.update(modes=list(schemathesis.GenerationMode))  # valid bodies and invalid ones
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_request_gets_a_server_error(case, live):
    response = case.call(timeout=60)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error


def test_the_engine_serves_after_the_fuzz(live):
    out = live.client().completions.create(model="stories", prompt="Once upon a time", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4
