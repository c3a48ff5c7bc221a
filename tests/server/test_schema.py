"""Schemathesis against a live `afd serve`: requests generated from its /openapi.json never cause
a 5xx, and every status and response body is one the document declares.

The operations are driven from a plain test with hypothesis (schemathesis' own pytest plugin reads
pytest internals that pytest 9 no longer has).
"""

from __future__ import annotations

import time

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance, status_code_conformance

CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]


def test_the_api_keeps_its_openapi_document(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /generate",
        "GET /v1/models",
        "GET /health",
        "GET /metrics",
    }
    start = time.monotonic()
    calls = []
    for op in operations:

        @settings(
            max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True
        )
        @given(op.as_strategy())
        def one(case):
            response = case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)
            calls.append(response.status_code)

        one()
    assert time.monotonic() - start < 150
    assert 200 in calls and 400 in calls
