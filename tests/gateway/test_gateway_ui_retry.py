"""The web UI's retry of a dead-lettered job over HTTP, under the admission bound: a retry makes
the job unfinished again, so at ``AGENT_DISPATCH_MAX_DEPTH`` it is refused as a submit is (``429``,
``Retry-After``) and the job stays dead-lettered; with room it is retried. SQLite and PostgreSQL."""

from __future__ import annotations

import http.client
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_dispatch.models import WorkState
from tests.gateway._harness import BACKENDS, TOKENS, Reply, Running, gateway_settings, running_gateway

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=BACKENDS)
def gw(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Running]:
    backend = str(request.param)
    dsn = str(request.getfixturevalue("postgres_dsn")) if backend == "postgres" else None
    with running_gateway(gateway_settings(backend, tmp_path / "gw", dsn, max_depth=2)) as running:
        yield running


def post_form(gw: Running, path: str, form: dict[str, str], cookie: str = "") -> Reply:
    """A form post as a browser sends it (no redirect followed); the body is read."""
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Content-Type": "application/x-www-form-urlencoded", "Origin": gw.url}
    if cookie:
        headers["Cookie"] = cookie
    conn.request("POST", path, body=urllib.parse.urlencode(form), headers=headers)
    try:
        response = conn.getresponse()
        return Reply(response.status, dict(response.getheaders()), response.read())
    finally:
        conn.close()


def signed_in(gw: Running, job_id: str) -> tuple[str, str]:
    """Sign in to the UI as tenant-a: the session cookie and the CSRF token its pages carry."""
    login = post_form(gw, "/ui/login", {"token": TOKENS["tenant-a"]})
    assert login.status == 303, login.body
    cookie = login.headers["Set-Cookie"].split(";", 1)[0]
    page = gw.call("GET", f"/ui/jobs/{job_id}", tenant=None, headers={"Cookie": cookie})
    assert page.status == 200
    found = re.search(
        r'id="retry-form"[^>]*>\s*<input type="hidden" name="csrf" value="([^"]+)"', page.body.decode()
    )
    assert found, "the dead-lettered job's page offers the retry"
    return cookie, found.group(1)


def test_a_retry_at_the_bound_is_refused_with_429_and_the_job_stays_dead_lettered(gw: Running) -> None:
    dead = gw.submit().json()["job_id"]
    # A worker takes its delivery, dead-letters it (a poison envelope) and acknowledges it.
    (delivery,) = gw.transport.claim("w1", max_items=1, wait_s=1.0)
    assert delivery.work_item_id == dead
    gw.store.dead_letter(dead, reason="poison envelope")
    gw.transport.ack(delivery.receipt)
    first = gw.submit().json()["job_id"]
    assert gw.submit().status == 202  # two unfinished turns: the bound
    assert gw.submit().status == 429  # as a submit is refused now...
    cookie, csrf = signed_in(gw, dead)

    refused = post_form(gw, f"/ui/jobs/{dead}/retry", {"csrf": csrf}, cookie)
    assert refused.status == 429  # ...so is the retry, which would make a third
    assert int(refused.headers["Retry-After"]) >= 1
    assert "the queue is at its depth bound" in refused.body.decode()
    item = gw.store.get(dead)
    assert item.state is WorkState.DEAD_LETTER
    assert [r.event for r in gw.store.outcomes(dead)][-1] == "dead_letter"

    # Room again (one turn cancelled): the same retry goes through and the job is ready again.
    assert gw.call("POST", f"/api/graph/jobs/{first}/cancel").status == 200
    retried = post_form(gw, f"/ui/jobs/{dead}/retry", {"csrf": csrf}, cookie)
    assert retried.status == 303 and retried.headers["Location"] == f"/ui/jobs/{dead}"
    assert gw.store.get(dead).state is WorkState.READY
