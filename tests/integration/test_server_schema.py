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
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from kiln.server.testing import ServerProcess

KEY = "sk-schema"
AUTH = {"Authorization": f"Bearer {KEY}"}
# + a method a path does not take is a 405 whose Allow header lists the ones it does, and a
# protected route refuses a request without the key
# Rules JSON Schema cannot state: an EBNF grammar's or a regex's validity, a string that
# must hold JSON text (a tool call's arguments), a tool_choice naming a tool the request's
# tools do not hold, and lengths known once the prompt is tokenized (its tokens within
# max_input_len, plus max_tokens within the context). The server's 400 for them names the
# field (or ends with it): field -> the refusal's words (None: any).
UNSTATABLE = {"grammar": None, "regex": None, "tool_choice": None,
              "function.arguments": "is not valid JSON",
              "max_tokens": "maximum context length",
              "max_completion_tokens": "maximum context length",
              "messages": "this engine accepts at most", "prompt": "this engine accepts at most"}


@schemathesis.check
def schema_valid_data_is_accepted(ctx, response, case):
    """schemathesis's positive_data_acceptance (a request the schema allows is not refused),
    but for the rules of UNSTATABLE."""
    if response.status_code == 400:
        try:
            error = response.json()["error"]
            param, message = error["param"], error["message"]
        except (ValueError, KeyError, TypeError):
            param, message = None, ""
        for field, words in UNSTATABLE.items():
            if param is not None and (param == field or param.endswith("." + field)) \
                    and (words or "") in message:
                return None
    return positive_data_acceptance(ctx, response, case)


CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance,
          content_type_conformance, unsupported_method, allow_header_conformance, ignored_auth,
          schema_valid_data_is_accepted]
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
    from kiln.server.openapi import decimal_upto  # logit_bias keys: token ids 0..511

    assert req["logit_bias"]["propertyNames"]["pattern"] == decimal_upto(511)
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["tools"]["anyOf"][0] == {"type": "array", "maxItems": 0}  # no tool parser
    rules = doc["components"]["schemas"]["ChatMessage"]["allOf"]
    assert rules[1]["then"] == {"properties": {"tool_calls": {"type": "null"}}}
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


def test_the_token_id_pattern_matches_exactly_the_ids_of_the_vocabulary():
    import re

    from kiln.server.openapi import decimal_upto

    for top in (0, 7, 9, 10, 99, 100, 511, 1000, 1009, 32000, 151935):
        pattern = re.compile(decimal_upto(top))
        for v in range(min(top + 60, 200_000)):
            assert bool(pattern.match(str(v))) == (v <= top), (top, v)
            assert bool(pattern.match(f"00{v}")) == (v <= top), (top, v)
        assert not pattern.match("") and not pattern.match("-1") and not pattern.match("1 ")
        assert not pattern.match("0" * 9 + "1")  # at most 8 leading zeros (the server: 18 chars)
