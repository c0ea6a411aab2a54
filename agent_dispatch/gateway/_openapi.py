"""The gateway's OpenAPI 3.1 document: schemas generated from the pydantic models, paths listed here.

The request and answer bodies are the models in :mod:`agent_dispatch.gateway._models` (answers
are built through them too), so the document cannot restate them wrongly. What is written here
is only what no model knows: the routes, their status codes and headers. A property-based tester
(``tests/gateway/test_openapi_fuzz.py``) checks the document against a running gateway. Limits
come from the settings in force, so the document a gateway serves describes that gateway.
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from agent_dispatch.gateway._models import (
    BODY_OVERHEAD,
    DEFAULT_PAGE,
    IDEMPOTENCY_KEY_PATTERN,
    MAX_BATCH,
    MAX_PAGE,
    REF_PATTERN,
    BatchBody,
    BatchResult,
    BatchTurnBody,
    ErrorBody,
    JobHandle,
    JobList,
    JobView,
    TurnBody,
)
from agent_dispatch.models import WorkState
from agent_dispatch.settings import Settings

VERSION: Final = "0.1.0"
_REF_TEMPLATE: Final = "#/components/schemas/{model}"

#: Requests are documented as they are validated, answers as they are serialised.
MODELS: Final[list[tuple[type[BaseModel], JsonSchemaMode]]] = [
    (TurnBody, "validation"),
    (BatchTurnBody, "validation"),
    (BatchBody, "validation"),
    (JobHandle, "serialization"),
    (JobView, "serialization"),
    (JobList, "serialization"),
    (BatchResult, "serialization"),
    (ErrorBody, "serialization"),
]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF_TEMPLATE.format(model=model.__name__)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": _json(_ref(ErrorBody))}
    if headers:
        out["headers"] = headers
    return out


_RETRY_AFTER: Final = {
    "Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}
}
_AUTH_ERROR: Final = {
    "description": "No bearer token, or one no tenant holds",
    "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
    "content": _json(_ref(ErrorBody)),
}
_UNAVAILABLE: Final = _error(
    "The WorkItem store or transport is unavailable, or the depth probe failed", _RETRY_AFTER
)
_NOT_FOUND: Final = _error("No such job for this tenant")
_BAD_HEADER: Final = _error("The body is not JSON, or the Idempotency-Key header is malformed")


def schemas(settings: Settings) -> dict[str, Any]:
    """The component schemas, generated from the models, with the limits of ``settings``."""
    _, top = models_json_schema(MODELS, ref_template=_REF_TEMPLATE)
    found: dict[str, Any] = top["$defs"]
    payload = (
        "Any JSON value (no NaN/Infinity); stored as compact UTF-8 JSON of at most "
        f"{settings.max_payload_bytes} bytes"
    )
    for name in (TurnBody.__name__, BatchTurnBody.__name__):
        found[name]["properties"]["payload"] = {"description": payload}
    # A batch's turns are validated one by one (one bad turn must not refuse the others), so the
    # model takes plain objects; each one is a BatchTurnBody.
    found[BatchBody.__name__]["properties"]["turns"]["items"] = _ref(BatchTurnBody)
    found.pop("JsonValue", None)
    return found


def _paths(settings: Settings) -> dict[str, Any]:
    job_id = {
        "name": "job_id",
        "in": "path",
        "required": True,
        # A path segment: the reference shape without '/'.
        "schema": {"type": "string", "pattern": REF_PATTERN.replace("/", "")},
    }
    idempotency = {
        "name": "Idempotency-Key",
        "in": "header",
        "required": False,
        "description": "Resubmitting with the same key returns the same job (created: false)",
        "schema": {"type": "string", "pattern": IDEMPOTENCY_KEY_PATTERN},
    }
    too_large = _error(
        f"The body is over {settings.max_payload_bytes + BODY_OVERHEAD} bytes, or the payload over "
        f"{settings.max_payload_bytes} bytes"
    )
    states = [s.value for s in WorkState]
    return {
        "/api/turns": {
            "post": {
                "operationId": "submitTurn",
                "summary": "Submit one turn",
                "parameters": [idempotency],
                "requestBody": {"required": True, "content": _json(_ref(TurnBody))},
                "responses": {
                    "202": {
                        "description": "Accepted: the job handle",
                        "headers": {"Location": {"schema": {"type": "string"}}},
                        "content": _json(_ref(JobHandle)),
                    },
                    "400": _BAD_HEADER,
                    "401": _AUTH_ERROR,
                    "409": _error("The Idempotency-Key was used before for a different request"),
                    "413": too_large,
                    "422": _error("A field is invalid; `field` names it"),
                    "429": _error("The queue is at AGENT_DISPATCH_MAX_DEPTH", _RETRY_AFTER),
                    "503": _UNAVAILABLE,
                },
            }
        },
        "/api/turns:batch": {
            "post": {
                "operationId": "submitTurns",
                "summary": f"Submit up to {MAX_BATCH} turns; each gets its own result",
                "description": (
                    "With an Idempotency-Key header, turn i without its own idempotency_key uses "
                    "`<key>/<i>`. The whole body is bounded like a single turn's."
                ),
                "parameters": [idempotency],
                "requestBody": {"required": True, "content": _json(_ref(BatchBody))},
                "responses": {
                    "200": {"description": "One result per turn", "content": _json(_ref(BatchResult))},
                    "400": _BAD_HEADER,
                    "401": _AUTH_ERROR,
                    "413": too_large,
                    "422": _error("The batch itself is invalid (each turn's problems are in its result)"),
                    "503": _UNAVAILABLE,
                },
            }
        },
        "/api/graph/jobs": {
            "get": {
                "operationId": "listJobs",
                "summary": "The caller's jobs, newest first, paginated",
                "parameters": [
                    {
                        "name": "state",
                        "in": "query",
                        "required": False,
                        "description": "Only these states (repeat, or separate with commas)",
                        "schema": {"type": "string", "enum": states},
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": MAX_PAGE,
                            "default": DEFAULT_PAGE,
                        },
                    },
                    {
                        "name": "after",
                        "in": "query",
                        "required": False,
                        "description": "next_after of the previous page",
                        "schema": {"type": "string", "pattern": REF_PATTERN},
                    },
                ],
                "responses": {
                    "200": {"description": "A page of jobs", "content": _json(_ref(JobList))},
                    "401": _AUTH_ERROR,
                    "422": _error("A query parameter is invalid; `field` names it"),
                    "503": _UNAVAILABLE,
                },
            }
        },
        "/api/graph/jobs/{job_id}": {
            "get": {
                "operationId": "getJob",
                "summary": "The status projection of one job",
                "parameters": [job_id],
                "responses": {
                    "200": {"description": "The job", "content": _json(_ref(JobView))},
                    "401": _AUTH_ERROR,
                    "404": _NOT_FOUND,
                    "503": _UNAVAILABLE,
                },
            }
        },
        "/api/graph/jobs/{job_id}/cancel": {
            "post": {
                "operationId": "cancelJob",
                "summary": "Cancel a job; a running turn's worker is refused at its next side effect",
                "description": "Cancelling a finished job changes nothing and answers 200 with changed: false.",
                "parameters": [job_id],
                "responses": {
                    "200": {"description": "The job, now cancelled", "content": _json(_ref(JobView))},
                    "401": _AUTH_ERROR,
                    "404": _NOT_FOUND,
                    "409": _error("The job cannot be cancelled from its state"),
                    "503": _UNAVAILABLE,
                },
            }
        },
        **_operations(),
    }


def _operations() -> dict[str, Any]:
    """The unauthenticated probes, metrics and this document."""
    anything = _json({"type": "object"})

    def get(operation_id: str, summary: str, responses: dict[str, Any]) -> dict[str, Any]:
        return {
            "get": {"operationId": operation_id, "summary": summary, "security": [], "responses": responses}
        }

    return {
        "/healthz": get("healthz", "Liveness", {"200": {"description": "Alive", "content": anything}}),
        "/readyz": get(
            "readyz",
            "Readiness: the store answers and the queue depth can be measured",
            {
                "200": {"description": "Ready", "content": anything},
                "503": {"description": "Not ready", "content": anything},
            },
        ),
        "/metrics": get(
            "metrics",
            "Prometheus metrics",
            {"200": {"description": "Metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}},
        ),
        "/openapi.json": get(
            "openapi", "This document", {"200": {"description": "OpenAPI 3", "content": anything}}
        ),
    }


def openapi_document(settings: Settings) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "agent-dispatch gateway",
            "version": VERSION,
            "description": (
                "Admits AI-agent turns under a hard queue-depth bound and reports their WorkItems. "
                "The gateway never runs a turn itself. A tenant sees and cancels only its own jobs: "
                "another tenant's job is 404."
            ),
        },
        "security": [{"bearerAuth": []}],
        "paths": _paths(settings),
        "components": {
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A token whose sha256 is listed for a tenant in AGENT_DISPATCH_TOKENS_FILE",
                }
            },
            "schemas": schemas(settings),
        },
    }
