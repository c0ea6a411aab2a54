"""The gateway's OpenAPI 3 document, written by hand to match the handlers.

It is checked against a running gateway by a property-based tester
(``tests/gateway/test_openapi_fuzz.py``): every generated request must get a documented status
code and a body matching the schema here, and never a 5xx. Limits come from the settings in
force, so the document a gateway serves describes that gateway.
"""

from __future__ import annotations

from typing import Any, Final

from agent_dispatch.gateway._models import (
    BODY_OVERHEAD,
    DEFAULT_PAGE,
    IDEMPOTENCY_KEY_PATTERN,
    KIND_PATTERN,
    MAX_BATCH,
    MAX_DEADLINE_S,
    MAX_DEPENDENCIES,
    MAX_PAGE,
    REF_PATTERN,
)
from agent_dispatch.models import WorkState
from agent_dispatch.settings import Settings

VERSION: Final = "0.1.0"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": _json(_ref("Error"))}
    if headers:
        out["headers"] = headers
    return out


_RETRY_AFTER: Final = {
    "Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}
}
_AUTH_ERROR: Final = {
    "description": "No bearer token, or one no tenant holds",
    "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
    "content": _json(_ref("Error")),
}
_UNAVAILABLE: Final = "The WorkItem store or transport is unavailable, or the depth probe failed"


def _turn_properties(settings: Settings) -> dict[str, Any]:
    return {
        "kind": {"type": "string", "pattern": KIND_PATTERN, "description": "Executor-defined turn kind"},
        "payload": {
            "description": (
                "Any JSON value (no NaN/Infinity); stored as compact UTF-8 JSON of at most "
                f"{settings.max_payload_bytes} bytes"
            ),
        },
        "session_id": {
            "type": "string",
            "pattern": REF_PATTERN,
            "description": "Turns of one session run one at a time, in order; default: the job id",
        },
        "priority": {"type": "integer", "minimum": -1000, "maximum": 1000, "default": 0},
        "deadline": {
            "description": "After it, the turn is cancelled instead of run. RFC 3339 with an offset, or seconds from now",
            "oneOf": [
                {"type": "string", "format": "date-time"},
                {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_DEADLINE_S},
            ],
        },
        "depends_on": {
            "type": "array",
            "maxItems": MAX_DEPENDENCIES,
            "items": {"type": "string", "pattern": REF_PATTERN},
            "description": "Job ids of this tenant that must succeed first",
        },
        "max_attempts": {"type": "integer", "minimum": 1, "maximum": 100},
    }


def _schemas(settings: Settings) -> dict[str, Any]:
    states = [s.value for s in WorkState]
    turn_props = _turn_properties(settings)
    timestamp = {"type": ["string", "null"], "format": "date-time"}
    return {
        "TurnRequest": {
            "type": "object",
            "additionalProperties": False,
            "required": ["kind", "payload"],
            "properties": turn_props,
        },
        "BatchTurn": {
            "type": "object",
            "additionalProperties": False,
            "required": ["kind", "payload"],
            "properties": {
                **turn_props,
                "idempotency_key": {"type": "string", "pattern": IDEMPOTENCY_KEY_PATTERN},
            },
        },
        "BatchRequest": {
            "type": "object",
            "additionalProperties": False,
            "required": ["turns"],
            "properties": {
                "turns": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": MAX_BATCH,
                    "items": _ref("BatchTurn"),
                }
            },
        },
        "JobHandle": {
            "type": "object",
            "required": ["job_id", "work_item_id", "session_id", "state", "status_url", "created"],
            "properties": {
                "job_id": {"type": "string"},
                "work_item_id": {"type": "string"},
                "session_id": {"type": "string"},
                "state": {"type": "string", "enum": states},
                "status_url": {"type": "string", "description": "Path of the job's status"},
                "created": {
                    "type": "boolean",
                    "description": "false when an Idempotency-Key matched an earlier submission",
                },
            },
        },
        "BatchItemResult": {
            "type": "object",
            "required": ["index", "status"],
            "description": "A job handle (status 202) or an error (any other status) for one turn",
            "properties": {
                "index": {"type": "integer", "minimum": 0},
                "status": {"type": "integer", "enum": [202, 400, 409, 413, 422, 429, 503]},
                "job_id": {"type": "string"},
                "state": {"type": "string", "enum": states},
                "error": {"type": "string"},
                "detail": {"type": "string"},
                "field": {"type": "string"},
            },
        },
        "BatchResult": {
            "type": "object",
            "required": ["accepted", "results"],
            "properties": {
                "accepted": {"type": "integer", "minimum": 0},
                "results": {"type": "array", "items": _ref("BatchItemResult")},
            },
        },
        "JobStatus": {
            "type": "object",
            "description": "The WorkItem itself (there is no second status record); never the payload",
            "required": [
                "job_id",
                "state",
                "terminal",
                "attempt",
                "max_attempts",
                "lease_epoch",
                "timestamps",
            ],
            "properties": {
                "job_id": {"type": "string"},
                "tenant": {"type": "string"},
                "kind": {"type": "string"},
                "queue": {"type": "string"},
                "session_id": {"type": "string"},
                "state": {"type": "string", "enum": states},
                "terminal": {"type": "boolean"},
                "attempt": {"type": "integer", "minimum": 0},
                "max_attempts": {"type": "integer", "minimum": 1},
                "lease_epoch": {"type": "integer", "minimum": 0},
                "fencing_token": {"type": "integer", "minimum": 0},
                "lease_owner": {"type": ["string", "null"]},
                "priority": {"type": "integer"},
                "depends_on": {"type": "array", "items": {"type": "string"}},
                "timestamps": {
                    "type": "object",
                    "required": ["created_at", "updated_at"],
                    "properties": {
                        "created_at": {"type": "string", "format": "date-time"},
                        "updated_at": {"type": "string", "format": "date-time"},
                        "deadline": timestamp,
                        "lease_expires_at": timestamp,
                        "not_before": timestamp,
                    },
                },
                "outcome": {"type": ["string", "null"], "enum": ["succeeded", "failed", "cancelled", None]},
                "error": {"type": ["string", "null"]},
                "changed": {
                    "type": "boolean",
                    "description": "cancel only: false when the job had already finished (it shows how)",
                },
            },
        },
        "JobList": {
            "type": "object",
            "required": ["jobs", "next_after"],
            "properties": {
                "jobs": {"type": "array", "items": _ref("JobStatus")},
                "next_after": {
                    "type": ["string", "null"],
                    "description": "Pass as `after` for the next page; null on the last page",
                },
            },
        },
        "Error": {
            "type": "object",
            "required": ["error", "detail"],
            "properties": {
                "error": {"type": "string", "description": "A stable machine-readable code"},
                "detail": {"type": "string"},
                "field": {"type": "string", "description": "The request field or header at fault"},
                "errors": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["field", "message"],
                        "properties": {"field": {"type": "string"}, "message": {"type": "string"}},
                    },
                },
            },
        },
    }


def openapi_document(settings: Settings) -> dict[str, Any]:
    job_id = {
        "name": "job_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": r"^[A-Za-z0-9._:@+=-]{1,200}$"},
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
        "paths": {
            "/api/turns": {
                "post": {
                    "operationId": "submitTurn",
                    "summary": "Submit one turn",
                    "parameters": [idempotency],
                    "requestBody": {"required": True, "content": _json(_ref("TurnRequest"))},
                    "responses": {
                        "202": {
                            "description": "Accepted: the job handle",
                            "headers": {"Location": {"schema": {"type": "string"}}},
                            "content": _json(_ref("JobHandle")),
                        },
                        "400": _error("The body is not JSON, or the Idempotency-Key header is malformed"),
                        "401": _AUTH_ERROR,
                        "409": _error("The Idempotency-Key was used before for a different request"),
                        "413": too_large,
                        "422": _error("A field is invalid; `field` names it"),
                        "429": _error("The queue is at AGENT_DISPATCH_MAX_DEPTH", _RETRY_AFTER),
                        "503": _error(_UNAVAILABLE, _RETRY_AFTER),
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
                    "requestBody": {"required": True, "content": _json(_ref("BatchRequest"))},
                    "responses": {
                        "200": {"description": "One result per turn", "content": _json(_ref("BatchResult"))},
                        "400": _error("The body is not JSON, or the Idempotency-Key header is malformed"),
                        "401": _AUTH_ERROR,
                        "413": too_large,
                        "422": _error("The batch itself is invalid (each turn's problems are in its result)"),
                        "503": _error(_UNAVAILABLE, _RETRY_AFTER),
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
                            "schema": {"type": "string", "enum": [s.value for s in WorkState]},
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
                        "200": {"description": "A page of jobs", "content": _json(_ref("JobList"))},
                        "401": _AUTH_ERROR,
                        "422": _error("A query parameter is invalid; `field` names it"),
                        "503": _error(_UNAVAILABLE, _RETRY_AFTER),
                    },
                }
            },
            "/api/graph/jobs/{job_id}": {
                "get": {
                    "operationId": "getJob",
                    "summary": "The status projection of one job",
                    "parameters": [job_id],
                    "responses": {
                        "200": {"description": "The job", "content": _json(_ref("JobStatus"))},
                        "401": _AUTH_ERROR,
                        "404": _error("No such job for this tenant"),
                        "503": _error(_UNAVAILABLE, _RETRY_AFTER),
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
                        "200": {"description": "The job, now cancelled", "content": _json(_ref("JobStatus"))},
                        "401": _AUTH_ERROR,
                        "404": _error("No such job for this tenant"),
                        "503": _error(_UNAVAILABLE, _RETRY_AFTER),
                    },
                }
            },
            "/healthz": {
                "get": {
                    "operationId": "healthz",
                    "summary": "Liveness",
                    "security": [],
                    "responses": {"200": {"description": "Alive", "content": _json({"type": "object"})}},
                }
            },
            "/readyz": {
                "get": {
                    "operationId": "readyz",
                    "summary": "Readiness: the store answers and the queue depth can be measured",
                    "security": [],
                    "responses": {
                        "200": {"description": "Ready", "content": _json({"type": "object"})},
                        "503": {"description": "Not ready", "content": _json({"type": "object"})},
                    },
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "summary": "Prometheus metrics",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "Metrics",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "summary": "This document",
                    "security": [],
                    "responses": {"200": {"description": "OpenAPI 3", "content": _json({"type": "object"})}},
                }
            },
        },
        "components": {
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A token whose sha256 is listed for a tenant in AGENT_DISPATCH_TOKENS_FILE",
                }
            },
            "schemas": _schemas(settings),
        },
    }
