"""The gateway over HTTP, against a running server on SQLite and on a real PostgreSQL.

Every status code the API documents, idempotency, batches, pagination, cancellation of queued
and running turns, and tenant isolation.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from agent_dispatch.errors import Cancelled
from agent_dispatch.models import Outcome, WorkState
from tests.gateway._harness import BACKENDS, TOKENS, Running, gateway_settings, running_gateway

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def dsn(backend: str, request: pytest.FixtureRequest) -> str | None:
    return str(request.getfixturevalue("postgres_dsn")) if backend == "postgres" else None


@pytest.fixture
def gw(backend: str, dsn: str | None, tmp_path: Path) -> Iterator[Running]:
    with running_gateway(gateway_settings(backend, tmp_path / "gw", dsn)) as running:
        yield running


def wait_state(gw: Running, job_id: str, states: set[str], timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        view: dict[str, Any] = gw.call("GET", f"/api/graph/jobs/{job_id}").json()
        if view["state"] in states:
            return view
        assert time.monotonic() < deadline, f"job {job_id} still {view['state']}, wanted {states}"
        time.sleep(0.05)


# --- submission ------------------------------------------------------------------------------


def test_submit_answers_202_with_a_job_handle(gw: Running) -> None:
    reply = gw.submit(
        {"kind": "summarise", "payload": {"text": "hello"}, "session_id": "chat-1", "priority": 5}
    )
    assert reply.status == 202, reply.body
    handle = reply.json()
    assert set(handle) >= {"job_id", "work_item_id", "session_id", "state", "status_url"}
    assert handle["job_id"] == handle["work_item_id"]
    assert handle["session_id"] == "chat-1"
    assert handle["state"] in {"ready", "leased", "running", "succeeded"}
    assert handle["status_url"] == f"/api/graph/jobs/{handle['job_id']}"
    assert reply.headers["Location"] == handle["status_url"]

    # The WorkItem holds the payload as bytes; the tenant is the token's, never the body's.
    item = gw.store.get(handle["job_id"], tenant="tenant-a")
    assert item.tenant == "tenant-a" and item.priority == 5 and item.kind == "summarise"
    assert json.loads(gw.store.get_payload(item.id, tenant="tenant-a")) == {"text": "hello"}

    status = gw.call("GET", handle["status_url"])
    assert status.status == 200
    view = status.json()
    assert view["job_id"] == handle["job_id"]
    assert {"state", "attempt", "max_attempts", "lease_epoch", "timestamps", "outcome"} <= set(view)


def test_tenant_in_the_body_is_refused(gw: Running) -> None:
    reply = gw.submit({"kind": "t", "payload": {}, "tenant": "tenant-b"})
    assert reply.status == 422
    assert reply.json()["field"] == "tenant"


def test_deadline_as_rfc3339_or_seconds(gw: Running) -> None:
    when = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    a = gw.submit({"kind": "t", "payload": 1, "deadline": when}).json()
    b = gw.submit({"kind": "t", "payload": 2, "deadline": 600}).json()
    da = gw.store.get(a["job_id"]).deadline
    db = gw.store.get(b["job_id"]).deadline
    assert da is not None and abs((da - datetime.fromisoformat(when)).total_seconds()) < 1
    assert db is not None and 590 < (db - datetime.now(UTC)).total_seconds() <= 600


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"payload": {}}, "kind"),
        ({"kind": "t"}, "payload"),
        ({"kind": "bad kind!", "payload": {}}, "kind"),
        ({"kind": "t", "payload": {}, "priority": 5000}, "priority"),
        ({"kind": "t", "payload": {}, "priority": "high"}, "priority"),
        ({"kind": "t", "payload": {}, "deadline": "2001-01-01T00:00:00Z"}, "deadline"),
        ({"kind": "t", "payload": {}, "deadline": "tomorrow"}, "deadline"),
        ({"kind": "t", "payload": {}, "deadline": "2030-01-01T00:00:00"}, "deadline"),
        ({"kind": "t", "payload": {}, "deadline": -5}, "deadline"),
        ({"kind": "t", "payload": {}, "max_attempts": 0}, "max_attempts"),
        ({"kind": "t", "payload": {}, "session_id": "has space"}, "session_id"),
        ({"kind": "t", "payload": {}, "depends_on": ["ok", "not ok"]}, "depends_on.1"),
        ({"kind": "t", "payload": {}, "surprise": 1}, "surprise"),
        ([1, 2], "body"),
    ],
)
def test_invalid_body_is_422_naming_the_field(gw: Running, body: Any, field: str) -> None:
    reply = gw.call("POST", "/api/turns", body=body)
    assert reply.status == 422, reply.body
    assert reply.json()["field"] == field
    assert field in reply.json()["detail"]


def test_malformed_json_is_400(gw: Running) -> None:
    reply = gw.call("POST", "/api/turns", raw=b'{"kind": "t", "payload": ')
    assert reply.status == 400
    assert reply.json() == {
        "error": "malformed_json",
        "detail": "the request body is not valid JSON",
        "field": "body",
    }


def test_bad_idempotency_header_is_400(gw: Running) -> None:
    reply = gw.submit(key="has spaces in it")
    assert reply.status == 400
    assert reply.json()["field"] == "Idempotency-Key"


def test_unknown_dependency_is_422(gw: Running) -> None:
    reply = gw.submit({"kind": "t", "payload": {}, "depends_on": ["no-such-job"]})
    assert reply.status == 422
    assert reply.json()["field"] == "depends_on"


def test_payload_over_the_limit_is_413(backend: str, dsn: str | None, tmp_path: Path) -> None:
    settings = gateway_settings(backend, tmp_path / "small", dsn, max_payload_bytes=1024)
    with running_gateway(settings) as gw:
        # Payload just at the limit (as compact JSON) passes; one byte more does not.
        at_limit = "x" * (1024 - 2)
        assert gw.submit({"kind": "t", "payload": at_limit}).status == 202
        reply = gw.submit({"kind": "t", "payload": at_limit + "x"})
        assert reply.status == 413 and reply.json()["field"] == "payload"
        # A body past the body limit is refused from its Content-Length, before it is read.
        huge = json.dumps({"kind": "t", "payload": "y" * (200 * 1024)}).encode()
        reply = gw.call("POST", "/api/turns", raw=huge)
        assert reply.status == 413 and reply.json()["error"] == "payload_too_large"
        # Without a Content-Length (chunked), the body read is bounded too.
        reply = gw.chunked("/api/turns", [b'{"kind": "t", "payload": "', b"z" * (100 * 1024), b'"}'])
        assert reply.status == 413
        # Batches are bounded the same way.
        reply = gw.call(
            "POST", "/api/turns:batch", body={"turns": [{"kind": "t", "payload": at_limit + "x"}]}
        )
        assert reply.status == 200 and reply.json()["results"][0]["status"] == 413


def test_queue_full_is_429_with_retry_after(backend: str, dsn: str | None, tmp_path: Path) -> None:
    with running_gateway(gateway_settings(backend, tmp_path / "full", dsn, max_depth=2)) as gw:
        assert gw.submit().status == 202
        assert gw.submit().status == 202
        reply = gw.submit()
        assert reply.status == 429
        assert int(reply.headers["Retry-After"]) >= 1
        assert reply.json()["error"] == "queue_full"
        # Nothing was left behind by the refusal: only the two accepted turns exist.
        assert len(gw.call("GET", "/api/graph/jobs?state=ready&state=submitted").json()["jobs"]) == 2


def test_depth_probe_failure_is_503_and_nothing_is_accepted(gw: Running) -> None:
    """Fail closed: with the admission counter gone the depth is unknown, never taken as zero."""
    assert gw.submit().status == 202
    _delete_depth_counter(gw)
    reply = gw.submit({"kind": "t", "payload": {"after": "probe failure"}})
    assert reply.status == 503
    assert reply.json()["error"] == "depth_unavailable"
    assert int(reply.headers["Retry-After"]) >= 1
    batch = gw.call("POST", "/api/turns:batch", body={"turns": [{"kind": "t", "payload": 1}]})
    assert [r["status"] for r in batch.json()["results"]] == [503]
    ready = gw.call("GET", "/readyz", tenant=None)
    assert ready.status == 503 and ready.json()["checks"]["transport"] == "DepthUnavailable"
    assert len(gw.call("GET", "/api/graph/jobs").json()["jobs"]) == 1  # only the turn from before


def _delete_depth_counter(gw: Running) -> None:
    gw.execute_in_database("DELETE FROM agent_dispatch_queue_depth")


# --- idempotency and batches -----------------------------------------------------------------


def test_idempotency_key_returns_the_same_job(gw: Running) -> None:
    body = {"kind": "t", "payload": {"n": 1}}
    first = gw.submit(body, key="order-42")
    again = gw.submit(body, key="order-42")
    assert first.status == again.status == 202
    assert first.json()["job_id"] == again.json()["job_id"]
    assert first.json()["created"] is True and again.json()["created"] is False
    # The same key under another tenant is another job: keys are scoped per tenant.
    other = gw.submit(body, key="order-42", tenant="tenant-b")
    assert other.status == 202 and other.json()["job_id"] != first.json()["job_id"]
    # Reusing the key for a different request is a conflict, not a silent duplicate.
    conflict = gw.submit({"kind": "t", "payload": {"n": 2}}, key="order-42")
    assert conflict.status == 409
    assert conflict.json()["field"] == "Idempotency-Key"
    listed = gw.call("GET", "/api/graph/jobs").json()["jobs"]
    assert [j["job_id"] for j in listed] == [first.json()["job_id"]]


def test_batch_gives_each_turn_its_own_result(gw: Running) -> None:
    turns = [
        {"kind": "t", "payload": {"i": 0}},
        {"kind": "bad kind", "payload": {}},
        {"kind": "t", "payload": {"i": 2}, "idempotency_key": "own-key"},
        {"kind": "t", "payload": {"i": 3}, "depends_on": ["missing-job"]},
    ]
    reply = gw.call("POST", "/api/turns:batch", body={"turns": turns}, headers={"Idempotency-Key": "batch-1"})
    assert reply.status == 200, reply.body
    results = reply.json()["results"]
    assert [r["index"] for r in results] == [0, 1, 2, 3]
    assert [r["status"] for r in results] == [202, 422, 202, 422]
    assert results[1]["field"] == "turns.1.kind"
    assert reply.json()["accepted"] == 2
    ids = [results[0]["job_id"], results[2]["job_id"]]
    # Replaying the batch with the same key gives the same jobs.
    again = gw.call("POST", "/api/turns:batch", body={"turns": turns}, headers={"Idempotency-Key": "batch-1"})
    assert [again.json()["results"][i]["job_id"] for i in (0, 2)] == ids
    assert all(not again.json()["results"][i]["created"] for i in (0, 2))
    # An explicit per-turn key works on its own too.
    single = gw.submit({"kind": "t", "payload": {"i": 2}}, key="own-key")
    assert single.json()["job_id"] == ids[1]


def test_batch_itself_invalid_is_422(gw: Running) -> None:
    assert gw.call("POST", "/api/turns:batch", body={"turns": []}).json()["field"] == "turns"
    assert gw.call("POST", "/api/turns:batch", body={"turns": [{}] * 501}).status == 422
    assert gw.call("POST", "/api/turns:batch", raw=b"nope").status == 400


def test_batch_over_the_bound_refuses_the_excess(backend: str, dsn: str | None, tmp_path: Path) -> None:
    with running_gateway(gateway_settings(backend, tmp_path / "bfull", dsn, max_depth=3)) as gw:
        turns = [{"kind": "t", "payload": {"i": i}} for i in range(5)]
        reply = gw.call("POST", "/api/turns:batch", body={"turns": turns})
        assert reply.status == 200
        statuses = [r["status"] for r in reply.json()["results"]]
        assert statuses.count(202) <= 3 and set(statuses) <= {202, 429}
        assert 429 in statuses


# --- listing ---------------------------------------------------------------------------------


def test_list_is_paginated_and_filtered(gw: Running) -> None:
    ids = [gw.submit({"kind": "t", "payload": {"i": i}}).json()["job_id"] for i in range(7)]
    cancelled = ids[3]
    assert gw.call("POST", f"/api/graph/jobs/{cancelled}/cancel").status == 200

    seen: list[str] = []
    after = None
    pages = 0
    while True:
        query = "/api/graph/jobs?limit=3" + (f"&after={after}" if after else "")
        page = gw.call("GET", query).json()
        pages += 1
        assert len(page["jobs"]) <= 3
        seen += [j["job_id"] for j in page["jobs"]]
        after = page["next_after"]
        if after is None:
            break
    assert pages == 3
    assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen))

    only = gw.call("GET", "/api/graph/jobs?state=cancelled").json()["jobs"]
    assert [j["job_id"] for j in only] == [cancelled]
    both = gw.call("GET", "/api/graph/jobs?state=cancelled,ready").json()["jobs"]
    assert len(both) == 7


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("state=done", "state"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=x", "limit"),
        ("after=a%20b", "after"),
    ],
)
def test_list_bad_query_is_422(gw: Running, query: str, field: str) -> None:
    reply = gw.call("GET", f"/api/graph/jobs?{query}")
    assert reply.status == 422 and reply.json()["field"] == field


# --- cancellation ----------------------------------------------------------------------------


def test_cancel_a_queued_turn(gw: Running) -> None:
    job_id = gw.submit().json()["job_id"]
    reply = gw.call("POST", f"/api/graph/jobs/{job_id}/cancel")
    assert reply.status == 200
    assert reply.json()["state"] == "cancelled" and reply.json()["changed"] is True
    # A second cancel changes nothing and says so.
    again = gw.call("POST", f"/api/graph/jobs/{job_id}/cancel").json()
    assert again["state"] == "cancelled" and again["changed"] is False
    assert gw.store.get(job_id).state is WorkState.CANCELLED


def test_cancel_a_running_turn_refuses_its_next_side_effect(gw: Running) -> None:
    """The lease holder learns of the cancel at its next fenced call, whatever it is."""
    job_id = gw.submit().json()["job_id"]
    lease = gw.store.claim("worker-under-test", work_item_id=job_id, ttl_s=60)
    assert lease is not None
    lease = gw.store.mark_running(lease)
    assert gw.call("GET", f"/api/graph/jobs/{job_id}").json()["state"] == "running"

    assert gw.call("POST", f"/api/graph/jobs/{job_id}/cancel").json()["state"] == "cancelled"
    with pytest.raises(Cancelled):
        gw.store.require_current(lease)  # what the lease guard calls before a side effect
    with pytest.raises(Cancelled):
        gw.store.renew(lease)
    with pytest.raises(Cancelled):
        gw.store.commit(lease, Outcome.SUCCEEDED)
    assert gw.store.get(job_id).state is WorkState.CANCELLED


def test_cancel_stops_a_turn_running_on_a_real_worker(backend: str, dsn: str | None, tmp_path: Path) -> None:
    from agent_dispatch.worker import build_worker

    settings = gateway_settings(backend, tmp_path / "w", dsn, executor="sleep", concurrency=1)
    with running_gateway(settings) as gw:
        worker = build_worker(settings)
        gw.closers += [worker.store.close, worker.transport.close, lambda: worker.stop(grace_s=2)]
        worker.start()
        job_id = gw.submit({"kind": "sleep", "payload": {"sleep_s": 60}}).json()["job_id"]
        wait_state(gw, job_id, {"running"})
        started = time.monotonic()
        assert gw.call("POST", f"/api/graph/jobs/{job_id}/cancel").json()["state"] == "cancelled"
        # The worker's lease guard is refused at its next renewal (every second here) and the
        # turn stops long before its 60 s; nothing is committed over the cancellation.
        deadline = time.monotonic() + 20
        while worker._in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not worker._in_flight, "the worker kept running a cancelled turn"
        assert time.monotonic() - started < 20
        view = gw.call("GET", f"/api/graph/jobs/{job_id}").json()
        assert view["state"] == "cancelled" and view["outcome"] in {None, "cancelled"}
        events = [r.event for r in gw.store.outcomes(job_id)]
        assert "committed" not in events or all(r.outcome != "succeeded" for r in gw.store.outcomes(job_id))


def test_a_turn_runs_to_completion_through_a_worker(backend: str, dsn: str | None, tmp_path: Path) -> None:
    from agent_dispatch.worker import build_worker

    settings = gateway_settings(backend, tmp_path / "ok", dsn)
    with running_gateway(settings) as gw:
        worker = build_worker(settings)
        gw.closers += [worker.store.close, worker.transport.close, lambda: worker.stop(grace_s=2)]
        worker.start()
        job_id = gw.submit({"kind": "t", "payload": {"q": 1}}).json()["job_id"]
        view = wait_state(gw, job_id, {"succeeded", "failed", "dead_letter", "cancelled"})
        assert view["state"] == "succeeded" and view["outcome"] == "succeeded"
        assert view["attempt"] == 1 and view["lease_epoch"] >= 1


# --- authentication and isolation ------------------------------------------------------------

API_CALLS = [
    ("POST", "/api/turns", {"kind": "t", "payload": {}}),
    ("POST", "/api/turns:batch", {"turns": [{"kind": "t", "payload": {}}]}),
    ("GET", "/api/graph/jobs", None),
    ("GET", "/api/graph/jobs/some-job", None),
    ("POST", "/api/graph/jobs/some-job/cancel", None),
]


@pytest.mark.parametrize(("method", "path", "body"), API_CALLS)
def test_no_or_bad_token_is_401(gw: Running, method: str, path: str, body: Any) -> None:
    for kwargs in [
        {"tenant": None},
        {"token": "not-a-token-anyone-holds"},
        {"tenant": None, "headers": {"Authorization": f"Basic {TOKENS['tenant-a']}"}},
        {"tenant": None, "headers": {"Authorization": "Bearer "}},
    ]:
        reply = gw.call(method, path, body=body, **kwargs)  # type: ignore[arg-type]
        assert reply.status == 401, (kwargs, reply.body)
        assert reply.headers["WWW-Authenticate"].startswith("Bearer")
        assert reply.json()["error"] in {"unauthenticated", "invalid_token"}
    assert (
        gw.call("GET", "/api/graph/jobs", tenant=None).headers["WWW-Authenticate"]
        == 'Bearer realm="agent-dispatch"'
    )
    assert (
        'error="invalid_token"'
        in gw.call("GET", "/api/graph/jobs", token="wrong").headers["WWW-Authenticate"]
    )
    assert gw.call("GET", "/api/graph/jobs", tenant=None).status == 401


def test_tenants_are_isolated(gw: Running) -> None:
    a_job = gw.submit(tenant="tenant-a").json()["job_id"]
    b_job = gw.submit(tenant="tenant-b").json()["job_id"]

    # B cannot read A's job: it does not exist as far as B can tell (404, same as a missing job).
    hidden = gw.call("GET", f"/api/graph/jobs/{a_job}", tenant="tenant-b")
    missing = gw.call("GET", "/api/graph/jobs/no-such-job", tenant="tenant-b")
    assert hidden.status == missing.status == 404
    assert hidden.json() == missing.json()
    # B cannot cancel it, and A's job is untouched.
    assert gw.call("POST", f"/api/graph/jobs/{a_job}/cancel", tenant="tenant-b").status == 404
    assert gw.call("GET", f"/api/graph/jobs/{a_job}", tenant="tenant-a").json()["state"] != "cancelled"
    # B's list has only B's job, whatever the filter or page cursor.
    assert [j["job_id"] for j in gw.call("GET", "/api/graph/jobs", tenant="tenant-b").json()["jobs"]] == [
        b_job
    ]
    # A's id as a page cursor reveals nothing either: an empty page, as for an unknown id.
    assert gw.call("GET", f"/api/graph/jobs?after={a_job}", tenant="tenant-b").json() == {
        "jobs": [],
        "next_after": None,
    }
    # And A still sees its own.
    assert [j["job_id"] for j in gw.call("GET", "/api/graph/jobs", tenant="tenant-a").json()["jobs"]] == [
        a_job
    ]


def test_unknown_job_is_404(gw: Running) -> None:
    assert gw.call("GET", "/api/graph/jobs/does-not-exist").status == 404
    assert gw.call("POST", "/api/graph/jobs/does-not-exist/cancel").status == 404


# --- operations ------------------------------------------------------------------------------


def test_health_readiness_metrics_and_openapi(gw: Running) -> None:
    assert gw.call("GET", "/healthz", tenant=None).json() == {"status": "ok"}
    ready = gw.call("GET", "/readyz", tenant=None)
    assert ready.status == 200 and ready.json()["status"] == "ready"
    gw.submit()
    gw.submit(tenant=None)
    metrics = gw.call("GET", "/metrics", tenant=None).body.decode()
    assert 'agent_dispatch_gateway_requests_total{code="202",route="/api/turns"}' in metrics
    assert 'agent_dispatch_gateway_requests_total{code="401",route="/api/turns"}' in metrics
    assert 'agent_dispatch_gateway_admissions_total{result="accepted"}' in metrics
    assert "agent_dispatch_gateway_request_duration_seconds_bucket" in metrics
    doc = gw.call("GET", "/openapi.json", tenant=None).json()
    assert doc["openapi"].startswith("3.")
    assert {"/api/turns", "/api/turns:batch", "/api/graph/jobs", "/api/graph/jobs/{job_id}"} <= set(
        doc["paths"]
    )
    assert set(doc["paths"]["/api/turns"]["post"]["responses"]) == {
        "202",
        "400",
        "401",
        "409",
        "413",
        "422",
        "429",
        "503",
    }


def test_unknown_route_and_method_are_json_errors(gw: Running) -> None:
    reply = gw.call("GET", "/api/nothing-here")
    assert reply.status == 404 and reply.json()["error"] == "not_found"
    reply = gw.call("DELETE", "/api/turns")
    assert reply.status == 405 and "POST" in reply.headers["Allow"]
