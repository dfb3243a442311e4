"""`kiln serve` against its own /openapi.json: schemathesis generates requests from the served
schema (valid and invalid ones) and checks that no response is a 5xx, that every status
code, content type and JSON body is one the schema documents, that other methods get 405
with Allow, and that protected routes refuse requests without the key.

Bounded: a tiny random float32 engine with a 64-token context (so max_tokens <= 63 in the
schema), derandomized generation, a fixed number of examples per operation, no shrinking.
"""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import (
    allow_header_conformance,
    content_type_conformance,
    ignored_auth,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from kiln.server.testing import ServerProcess

KEY = "sk-schema"
AUTH = {"Authorization": f"Bearer {KEY}"}
# + a method a path does not take is a 405 whose Allow header lists the ones it does, and a
# protected route refuses a request without the key
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance,
          content_type_conformance, unsupported_method, allow_header_conformance, ignored_auth]
EXAMPLES = 40  # per operation, on top of schemathesis's coverage cases (boundary values)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kiln.builder import build_engine

    out = tmp_path_factory.mktemp("serve-schema") / "tiny"
    build_engine("random:tiny-llama", out, dtype="float32", max_seq_len=64,
                 max_batch_size=16, progress=False)
    with ServerProcess(out, "--api-key", KEY, "--served-model-name", "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def test_schema_states_the_bounds(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    req = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert req["max_tokens"]["maximum"] == 63  # the context minus one prompt token
    assert req["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0, "maximum": 2}
    assert req["seed"]["anyOf"][0]["maximum"] == 2**64 - 1
    assert req["logit_bias"]["additionalProperties"]["maximum"] == 100
    assert doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"][
        "items"]["maximum"] == 511
    ops = doc["paths"]["/v1/chat/completions"]["post"]
    assert ops["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionRequest")
    assert {"200", "400", "401", "404", "413", "429", "503"} <= set(ops["responses"])
    assert ops["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
    assert httpx.get(server.url + "/docs").status_code == 200


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_api(case):
    case.call_and_validate(headers=AUTH, checks=CHECKS, timeout=60)


def test_no_traceback(server):
    """Run last: no request above made the server log an exception."""
    assert httpx.get(server.url + "/health").status_code == 200
    assert not [line for line in server.log if "Traceback" in line], "\n".join(server.log)
