"""The served OpenAPI document against the running gateway, by a property-based API tester.

Schemathesis reads ``/openapi.json`` from a live gateway (SQLite, real transport) and sends
generated requests, valid and invalid, to every operation. No request may get a 5xx, and every
answer must use a documented status code, content type, headers and body schema.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode

from tests.gateway._harness import TOKENS, Running, gateway_settings, running_gateway

pytestmark = pytest.mark.timeout(300)

#: Examples per operation and mode: enough to reach every branch, bounded to keep the run short.
EXAMPLES = 25
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def live_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    data_dir: Path = tmp_path_factory.mktemp("fuzz")
    # A small payload bound so generated bodies reach the 413 paths too.
    with running_gateway(gateway_settings("sqlite", data_dir, None, max_payload_bytes=2048)) as running:
        yield running


@pytest.fixture(scope="module")
def api_schema(live_gateway: Running) -> Any:
    return schemathesis.openapi.from_url(f"{live_gateway.url}/openapi.json")


# (method, path): every operation the document describes; the test below also checks the list
# is complete, so a new endpoint cannot slip past the fuzzer.
OPERATIONS = [
    ("POST", "/api/turns"),
    ("POST", "/api/turns:batch"),
    ("GET", "/api/graph/jobs"),
    ("GET", "/api/graph/jobs/{job_id}"),
    ("POST", "/api/graph/jobs/{job_id}/cancel"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
]


def test_every_documented_operation_is_fuzzed(api_schema: Any) -> None:
    documented = {
        (method.upper(), path) for path, item in api_schema.raw_schema["paths"].items() for method in item
    }
    assert documented == set(OPERATIONS)


#: Operations with inputs get invalid requests too; the rest have nothing to get wrong.
WITH_INPUTS = OPERATIONS[:5]
CASES = [
    pytest.param(method, path, mode, id=f"{method} {path} {mode.value}")
    for method, path in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or (method, path) in WITH_INPUTS
]


@pytest.mark.parametrize("authenticated", [True, False], ids=["token", "no-token"])
@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_no_server_error_and_documented_answers(
    api_schema: Any, live_gateway: Running, method: str, path: str, mode: GenerationMode, authenticated: bool
) -> None:
    operation = api_schema[path][method]
    headers = {"Authorization": f"Bearer {TOKENS['tenant-a']}"} if authenticated else {}

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES if authenticated else 5,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def exercise(case: Any) -> None:
        case.call_and_validate(base_url=live_gateway.url, headers=headers, checks=CHECKS, timeout=30)

    exercise()
