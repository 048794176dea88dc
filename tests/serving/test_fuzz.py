"""Requests generated from the app's own OpenAPI schema by schemathesis (bodies that fit it, and bodies that do not)
against the live server: no response is a server error or streams an error event, every refusal is an OpenAI-style
error, and the engine is empty afterwards. Derandomized: the same cases on every run."""
import pytest
import requests

from tests.serving.conftest import NAME

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)

OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model}"), ("GET", "/health"), ("GET", "/metrics")]
EXAMPLES = {"POST": 30, "GET": 10}  # per operation and mode
MAX_TOKENS = 2  # a sampled step takes ~0.3 s here (the runner sorts the whole vocabulary), a greedy one ~10 ms


@pytest.fixture(scope="module")
def api_schema(served):
    return schemathesis.openapi.from_dict(requests.get(served.url + "/openapi.json", timeout=10).json())


def test_schema_lists_every_operation(served, api_schema):
    ops = [op.ok() for op in api_schema.get_all_operations()]
    assert sorted((op.method.upper(), op.path) for op in ops) == sorted(OPERATIONS)
    raw = served.app.openapi()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatRequest")):
        body = raw["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}  # typed bodies: generated cases reach the fields
    fields = raw["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1}


# negative cases only where there is a body to get wrong (a path parameter is any string)
CASES = [(*op, "positive") for op in OPERATIONS] + [(*op, "negative") for op in OPERATIONS if op[0] == "POST"]


@pytest.mark.parametrize("method, path, mode", CASES)
def test_no_server_errors(served, api_schema, method, path, mode):
    operation, statuses = api_schema[path][method], []

    @given(case=operation.as_strategy(schemathesis.GenerationMode(mode)))
    @settings(max_examples=EXAMPLES[method], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case):
        if mode == "positive" and isinstance(case.body, dict):
            case.body["model"] = NAME  # the one name that gets past the 404, so that the engine runs the case
            # at most 2 sequences of 2 tokens: the engine's speed under load is test_load's business
            case.body["n"] = min(case.body.get("n") or 1, 2)
            for key in ("max_tokens", "max_completion_tokens"):
                case.body[key] = min(case.body.get(key) or MAX_TOKENS, MAX_TOKENS)
        response = case.call(base_url=served.url, timeout=120)
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.as_curl_command(), response.text)
        assert 'data: {"error"' not in response.text, (case.as_curl_command(), response.text)
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text
    check()
    if mode == "positive" and method == "POST":  # cases did reach the engine: the fuzz is not all 400s
        assert statuses.count(200) >= 5, statuses


def test_engine_is_empty_after_the_fuzz(served):
    served.wait_idle()
    assert requests.get(served.url + "/health", timeout=10).json() == {"status": "ok"}
