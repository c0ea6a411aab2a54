"""The web UI in a real headless browser: sign-in, live job pages, cancel, dead-letter retry,
tenant isolation, the administrator's view, escaping and the Content-Security-Policy."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from agent_dispatch.settings import Settings
from agent_dispatch.stores.sqlite import SqliteStore
from tests.ui.conftest import OTHER_TOKEN, Server

pytestmark = [pytest.mark.ui, pytest.mark.timeout(300)]
LIVE_MS = 20_000  # live updates poll every 2 s; a turn that sleeps 0.3 s is done well within this


def submit(server: Server, token: str, payload: Any, **fields: Any) -> str:
    body = json.dumps({"kind": fields.pop("kind", "ui-test"), "payload": payload, **fields}).encode()
    request = urllib.request.Request(
        f"{server.url}/api/turns",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(json.loads(response.read())["job_id"])


def shot(page: Any, shots: list[Path], name: str) -> None:
    for d in shots:
        page.screenshot(path=str(d / f"{name}.png"), full_page=True)


def login(page: Any, server: Server, token: str) -> None:
    page.context.clear_cookies()
    page.goto(f"{server.url}/ui/")
    assert page.url.endswith("/ui/login")  # no session: the sign-in form
    page.get_by_label("Bearer token").fill(token)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{server.url}/ui/")


def store(server: Server) -> SqliteStore:
    settings = Settings(data_dir=server.data_dir)
    return SqliteStore(settings.sqlite_path, settings)


def test_login_overview_and_security_headers(page: Any, server: Server, shots: list[Path]) -> None:
    page.goto(f"{server.url}/ui/login")
    shot(page, shots, "login")
    page.get_by_label("Bearer token").fill("not-a-token")
    page.get_by_role("button", name="Sign in").click()
    assert page.get_by_role("alert").inner_text() == "That token is not valid."
    page.console_errors.clear()  # the refused sign-in's 401 is the browser's one expected error
    login(page, server, server.token)
    assert page.get_by_role("heading", level=1).inner_text() == "Overview"
    assert "local" in page.locator("header").inner_text()
    cookie = next(c for c in page.context.cookies() if c["name"] == "agent_dispatch_ui")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert server.token not in cookie["value"]
    response = page.goto(f"{server.url}/ui/")
    headers = response.headers
    assert "default-src 'self'" in headers["content-security-policy"]
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "same-origin"
    page.wait_for_function("() => document.querySelectorAll('#chart polyline').length > 0", timeout=LIVE_MS)
    assert page.locator("#bound").inner_text() == "100,000"
    assert page.locator("#depth").inner_text() != "unknown"
    # Still counts after the live refresh (each id names one element the refresh writes).
    assert page.locator("#worker-count").inner_text().isdigit()
    assert page.locator("#lease-count").inner_text().isdigit()
    # `up` runs on a laptop, not in a cluster: the overview says why no heartbeat is shown.
    assert page.locator("#heartbeat-note").inner_text().startswith("Not on Kubernetes")
    shot(page, shots, "overview")
    page.set_viewport_size({"width": 390, "height": 844})
    shot(page, shots, "overview-narrow")
    page.set_viewport_size({"width": 1280, "height": 900})
    assert page.console_errors == []


def test_a_submitted_turn_appears_and_reaches_succeeded(page: Any, server: Server, shots: list[Path]) -> None:
    login(page, server, server.token)
    page.goto(f"{server.url}/ui/jobs")
    job_id = submit(server, server.token, {"sleep_s": 0.3}, kind="appears")
    # The list refreshes itself: the new job shows up without a reload.
    page.get_by_role("link", name=job_id).wait_for(timeout=LIVE_MS)
    shot(page, shots, "jobs")
    page.get_by_role("link", name=job_id).click()
    page.wait_for_function(
        "() => document.getElementById('job-state').textContent === 'succeeded'", timeout=LIVE_MS
    )
    assert page.locator("#job-payload").inner_text() == "15 bytes"
    assert "commit" in page.locator("#attempts").inner_text()
    assert page.locator("#cancel-form").is_hidden() and page.locator("#retry-form").is_hidden()
    shot(page, shots, "job")
    page.goto(f"{server.url}/ui/jobs?state=succeeded&kind=appears")
    assert page.get_by_role("link", name=job_id).is_visible()
    page.goto(f"{server.url}/ui/jobs?state=running&kind=appears")
    assert page.get_by_role("link", name=job_id).count() == 0
    assert page.console_errors == []


def test_cancel_a_running_turn(page: Any, server: Server, shots: list[Path]) -> None:
    login(page, server, server.token)
    job_id = submit(server, server.token, {"sleep_s": 120}, kind="cancel-me")
    page.goto(f"{server.url}/ui/jobs/{job_id}")
    page.wait_for_function(
        "() => document.getElementById('job-state').textContent === 'running'", timeout=LIVE_MS
    )
    # The overview lists the worker holding its lease: no heartbeat Lease off Kubernetes.
    page.goto(f"{server.url}/ui/")
    page.wait_for_function(
        "(id) => document.getElementById('leases').textContent.includes(id)",
        arg=job_id,
        timeout=LIVE_MS,
    )
    row = page.locator("#worker-heartbeats tr", has_text="no Lease").first.inner_text()
    assert row.split("\t")[-1].strip().isdigit() and int(row.split("\t")[-1]) >= 1
    assert int(page.locator("#lease-count").inner_text()) >= 1
    shot(page, shots, "overview-busy")
    page.goto(f"{server.url}/ui/jobs/{job_id}")
    page.get_by_role("button", name="Cancel").click()
    page.wait_for_url(f"{server.url}/ui/jobs/{job_id}")
    assert page.locator("#job-state").inner_text() == "cancelled"
    assert store(server).get(job_id).state.value == "cancelled"
    assert page.console_errors == []


def test_a_dead_lettered_turn_is_shown_escaped_and_retried(
    page: Any, server: Server, shots: list[Path]
) -> None:
    login(page, server, server.token)
    job_id = submit(server, server.token, {"sleep_s": 120}, kind="poison")
    s = store(server)
    attack = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
    try:
        # The poison path (a worker's unfenced dead-letter), with markup in the stored reason.
        s.dead_letter(job_id, reason=attack)
    finally:
        s.close()
    page.goto(f"{server.url}/ui/jobs/{job_id}")
    assert page.locator("#job-state").inner_text() == "dead_letter"
    assert page.locator("#job-error").inner_text() == attack  # shown as text, not markup
    assert page.evaluate("window.__pwned === undefined")
    assert page.locator("#job-error img").count() == 0
    shot(page, shots, "job-dead-letter")
    page.get_by_role("button", name="Retry dead letter").click()
    page.wait_for_url(f"{server.url}/ui/jobs/{job_id}")
    page.wait_for_function(
        "() => ['ready', 'leased', 'running'].includes(document.getElementById('job-state').textContent)",
        timeout=LIVE_MS,
    )
    assert "retry_dead_letter" in page.locator("#attempts").inner_text()
    page.get_by_role("button", name="Cancel").click()  # do not leave a two-minute turn behind
    assert page.console_errors == []


def test_retrying_a_dead_lettered_job_that_waits_on_a_dependency_puts_it_back_to_waiting(
    page: Any, server: Server
) -> None:
    login(page, server, server.token)
    parent = submit(server, server.token, {"sleep_s": 120}, kind="parent")
    child = submit(server, server.token, {"sleep_s": 0.1}, kind="child", depends_on=[parent])
    s = store(server)
    try:
        assert s.get(child).state.value == "submitted"
        s.dead_letter(child, reason="poison envelope")
    finally:
        s.close()
    page.goto(f"{server.url}/ui/jobs/{child}")
    page.get_by_role("button", name="Retry dead letter").click()
    page.wait_for_url(f"{server.url}/ui/jobs/{child}")
    # Back to waiting for its dependency, not ready: nothing runs it before the parent succeeds.
    assert page.locator("#job-state").inner_text() == "submitted"
    assert page.get_by_role("link", name=parent).is_visible()  # its dependency, both ways
    page.goto(f"{server.url}/ui/jobs/{parent}")
    page.get_by_role("button", name="Cancel").click()  # the dependent is cancelled with it
    page.goto(f"{server.url}/ui/jobs/{child}")
    assert page.locator("#job-state").inner_text() == "cancelled"
    assert page.console_errors == []


def test_csp_blocks_inline_script(page: Any, server: Server) -> None:
    login(page, server, server.token)
    page.goto(f"{server.url}/ui/jobs")
    page.evaluate(
        "() => { const s = document.createElement('script'); s.textContent = 'window.__inline = 1';"
        " document.body.appendChild(s); }"
    )
    assert page.evaluate("window.__inline === undefined")
    assert any("Content Security Policy" in e for e in page.console_errors)


def test_another_tenants_job_is_404_and_the_admin_sees_every_tenant(
    page: Any, server: Server, shots: list[Path]
) -> None:
    theirs = submit(server, OTHER_TOKEN, {"sleep_s": 0.1}, kind="theirs")
    mine = submit(server, server.token, {"sleep_s": 0.1}, kind="mine")
    login(page, server, server.token)
    response = page.goto(f"{server.url}/ui/jobs/{theirs}")
    assert response.status == 404
    assert page.get_by_role("alert").inner_text() == "no such job"
    assert page.request.get(f"{server.url}/ui/api/jobs/{theirs}").status == 404
    page.goto(f"{server.url}/ui/jobs")
    assert page.get_by_role("link", name=theirs).count() == 0
    assert page.get_by_label("Tenant").count() == 0  # a tenant cannot pick another tenant
    page.goto(f"{server.url}/ui/tenants")
    assert "other" not in page.locator("#tenants").inner_text()
    assert page.locator("#tenants tr").count() == 1  # its own row only
    assert page.locator("#next-tenants").is_hidden()
    page.console_errors.clear()  # the 404 page's own status is logged by the browser
    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url(f"{server.url}/ui/login")

    login(page, server, server.admin_token)
    assert "administrator" in page.locator("header").inner_text()
    page.goto(f"{server.url}/ui/jobs")
    page.get_by_role("link", name=theirs).wait_for(timeout=LIVE_MS)
    assert page.get_by_role("link", name=mine).is_visible()
    page.get_by_label("Tenant").fill("other")
    page.get_by_role("button", name="Filter").click()
    page.get_by_role("link", name=theirs).wait_for(timeout=LIVE_MS)
    assert page.get_by_role("link", name=mine).count() == 0
    shot(page, shots, "jobs-admin")
    page.goto(f"{server.url}/ui/jobs/{theirs}")
    assert page.locator("#job-tenant").inner_text() == "other"
    page.goto(f"{server.url}/ui/tenants")
    page.wait_for_function(
        "() => ['local', 'other'].every(t => document.getElementById('tenants').textContent.includes(t))",
        timeout=LIVE_MS,
    )
    shot(page, shots, "tenants")
    # Paged in name order: one tenant a page, the next page behind "Next tenants".
    page.goto(f"{server.url}/ui/tenants?limit=1")
    assert [r.split("\t")[0] for r in page.locator("#tenants tr").all_inner_texts()] == ["local"]
    page.get_by_role("link", name="Next tenants").click()
    page.wait_for_url("**/ui/tenants?after=local&limit=1")
    assert [r.split("\t")[0] for r in page.locator("#tenants tr").all_inner_texts()] == ["other"]
    done = page.locator("#tenants tr td").nth(3).inner_text()
    assert int(done.replace(",", "")) >= 1  # its finished job, from the store's counters
    assert page.locator("#next-tenants").is_hidden()
    assert page.console_errors == []


def test_actions_need_the_sessions_csrf_token(page: Any, server: Server) -> None:
    job_id = submit(server, server.token, {"sleep_s": 120}, kind="csrf")
    login(page, server, server.token)
    refused = page.request.post(f"{server.url}/ui/jobs/{job_id}/cancel", form={"csrf": "forged"})
    assert refused.status == 403
    assert store(server).get(job_id).state.value != "cancelled"
    try:
        urllib.request.urlopen(urllib.request.Request(f"{server.url}/ui/api/overview"), timeout=10)
        raise AssertionError("the UI's JSON answered without a session")
    except urllib.error.HTTPError as exc:
        assert exc.code == 401
    page.goto(f"{server.url}/ui/jobs/{job_id}")
    page.get_by_role("button", name="Cancel").click()
    assert page.locator("#job-state").inner_text() == "cancelled"
