"""The pages' HTML: Python templates where every value passes through :func:`esc`.

No inline script or style anywhere (the Content-Security-Policy forbids both): behaviour is in
``static/ui.js``, looks in ``static/ui.css``.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from agent_dispatch.gateway.ui import _views as v
from agent_dispatch.models import WorkState


def esc(value: Any) -> str:
    return escape(str(value), quote=True)


def cell(value: v.Cell) -> str:
    if isinstance(value, list):
        return f'<a href="{esc(value[1])}">{esc(value[0])}</a>'
    return esc(value)


def table(table_id: str, caption: str, columns: Sequence[str], rows: Sequence[Sequence[v.Cell]]) -> str:
    head = "".join(f'<th scope="col">{esc(c)}</th>' for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(c)}</td>" for c in row) + "</tr>" for row in rows)
    return (
        f'<div class="scroll" tabindex="0" role="region" aria-label="{esc(caption)}"><table>'
        f"<caption>{esc(caption)}</caption><thead><tr>{head}</tr></thead>"
        f'<tbody id="{esc(table_id)}">{body}</tbody></table></div>'
    )


def field(field_id: str, model: dict[str, Any]) -> str:
    return f'<span id="{esc(field_id)}">{esc(model["fields"].get(field_id, ""))}</span>'


def page(title: str, body: str, *, who: str = "", csrf: str = "", live: str = "", kind: str = "") -> str:
    nav = ""
    if who:
        nav = (
            '<header><nav aria-label="Main"><ul>'
            '<li><a href="/ui/">Overview</a></li><li><a href="/ui/tenants">Tenants</a></li>'
            '<li><a href="/ui/jobs">Jobs</a></li></ul></nav>'
            f'<form method="post" action="/ui/logout" class="who"><span>Signed in as {esc(who)}</span>'
            f'<input type="hidden" name="csrf" value="{esc(csrf)}"><button type="submit">Sign out</button></form>'
            "</header>"
        )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} · agent-dispatch</title>"
        '<link rel="icon" href="/ui/static/favicon.svg" type="image/svg+xml">'
        '<link rel="stylesheet" href="/ui/static/ui.css">'
        '<script src="/ui/static/ui.js" defer></script></head>'
        f'<body data-live="{esc(live)}" data-page="{esc(kind)}" data-csrf="{esc(csrf)}">'
        '<a class="skip" href="#main">Skip to content</a>'
        f'{nav}<main id="main"><h1>{esc(title)}</h1>{body}'
        '<p class="status" role="status" aria-live="polite" id="live-status"></p></main></body></html>'
    )


def login(error: str = "") -> str:
    alert = f'<p class="error" role="alert">{esc(error)}</p>' if error else ""
    body = (
        f'{alert}<form method="post" action="/ui/login" class="card">'
        '<label for="token">Bearer token</label>'
        '<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>'
        '<button type="submit">Sign in</button>'
        "<p>A tenant's token shows that tenant's jobs; an administrator's token shows every tenant.</p>"
        "</form>"
    )
    return page("Sign in", body)


def error_page(status: int, detail: str, *, who: str = "", csrf: str = "") -> str:
    return page(
        f"{status}",
        f'<p class="error" role="alert">{esc(detail)}</p><p><a href="/ui/">Overview</a></p>',
        who=who,
        csrf=csrf,
    )


def overview(model: dict[str, Any]) -> str:
    def f(name: str) -> str:
        return field(name, model)

    stats = "".join(
        f'<div class="stat"><dt>{esc(label)}</dt><dd>{f("rate-" + key)} <small>total {f("total-" + key)}</small></dd></div>'
        for key, label in (
            ("admitted", "Admitted"),
            ("succeeded", "Succeeded"),
            ("failed", "Failed"),
            ("dead_lettered", "Dead-lettered"),
            ("cancelled", "Cancelled"),
        )
    )
    return (
        '<section aria-labelledby="q"><h2 id="q">Queue</h2><dl class="stats">'
        f'<div class="stat"><dt>Depth</dt><dd>{f("depth")} <small>of {f("bound")}</small> <small>{f("depth-pct")}</small></dd></div>'
        f"{stats}</dl>"
        '<figure><svg id="chart" viewBox="0 0 600 160" role="img" aria-labelledby="chart-title">'
        '<title id="chart-title">Depth and throughput over the last minutes</title></svg>'
        '<figcaption><span class="key depth">depth</span> <span class="key done">finished per sample</span> '
        '<span class="key admitted">admitted per sample</span> (a sample every 2 s, the last 5 minutes)</figcaption></figure></section>'
        f'<section aria-labelledby="w"><h2 id="w">Workers and leases</h2><p>{f("worker-count")} workers hold {f("lease-count")} leases.</p>'
        f"<p>Heartbeats: {f('heartbeat-note')}</p>"
        f"{table('worker-heartbeats', 'Workers: their heartbeat Lease and the WorkItem leases they hold', v.WORKER_COLUMNS, model['tables']['worker-heartbeats'])}"
        f"{table('leases', 'Leases held, soonest expiry first', v.LEASE_COLUMNS, model['tables']['leases'])}</section>"
    )


def tenants(model: dict[str, Any]) -> str:
    nxt = model["links"]["next-tenants"]
    hidden = " hidden" if model["hidden"]["next-tenants"] else ""
    return (
        f"<p>{field('tenant-count', model)} tenants on this page, in name order. Counts are the store's "
        "per-tenant counters; last served is the newest claim.</p>"
        f"{table('tenants', 'Tenants and fairness', v.TENANT_COLUMNS, model['tables']['tenants'])}"
        f'<p><a id="next-tenants" href="{esc(nxt)}"{hidden}>Next tenants</a></p>'
    )


def _select(name: str, label: str, options: Sequence[str], chosen: str) -> str:
    opts = "".join(
        f'<option value="{esc(o)}"{" selected" if o == chosen else ""}>{esc(o or "any")}</option>'
        for o in options
    )
    return f'<label for="f-{name}">{esc(label)}</label><select id="f-{name}" name="{name}">{opts}</select>'


def _text(name: str, label: str, value: str) -> str:
    return (
        f'<label for="f-{name}">{esc(label)}</label><input id="f-{name}" name="{name}" value="{esc(value)}">'
    )


def jobs(model: dict[str, Any], query: dict[str, str], *, admin: bool) -> str:
    states = ["", *(s.value for s in WorkState)]
    filters = (
        _select("state", "State", states, query.get("state", ""))
        + _text("kind", "Kind", query.get("kind", ""))
        + _text("session", "Session", query.get("session", ""))
        + (_text("tenant", "Tenant", query.get("tenant", "")) if admin else "")
    )
    nxt = model["links"]["next-page"]
    hidden = model["hidden"]
    return (
        f'<form method="get" action="/ui/jobs" class="filters" aria-label="Filter jobs">{filters}'
        '<button type="submit">Filter</button></form>'
        f"{table('jobs', 'Jobs, newest first', v.JOB_COLUMNS, model['tables']['jobs'])}"
        f'<p id="no-jobs"{" hidden" if hidden["no-jobs"] else ""}>No jobs match.</p>'
        f'<p><a id="next-page" href="{esc(nxt)}"{" hidden" if hidden["next-page"] else ""}>Next page</a></p>'
    )


def job(model: dict[str, Any], job_id: str, csrf: str) -> str:
    def f(name: str) -> str:
        return field(name, model)

    facts = "".join(
        f"<div><dt>{esc(label)}</dt><dd>{f(name)}</dd></div>"
        for name, label in (
            ("job-state", "State"),
            ("job-tenant", "Tenant"),
            ("job-kind", "Kind"),
            ("job-session", "Session"),
            ("job-attempt", "Attempt"),
            ("job-epoch", "Lease epoch"),
            ("job-token", "Fencing token"),
            ("job-owner", "Lease owner"),
            ("job-priority", "Priority"),
            ("job-payload", "Payload size"),
            ("job-created", "Created"),
            ("job-updated", "Updated"),
            ("job-deadline", "Deadline"),
            ("job-expires", "Lease expires"),
            ("job-outcome", "Outcome"),
            ("job-error", "Error"),
        )
    )
    hidden = model["hidden"]
    base = f"/ui/jobs/{esc(job_id)}"
    actions = (
        f'<form id="cancel-form" method="post" action="{base}/cancel"{" hidden" if hidden["cancel-form"] else ""}>'
        f'<input type="hidden" name="csrf" value="{esc(csrf)}"><button type="submit">Cancel</button></form>'
        f'<form id="retry-form" method="post" action="{base}/retry"{" hidden" if hidden["retry-form"] else ""}>'
        f'<input type="hidden" name="csrf" value="{esc(csrf)}"><button type="submit">Retry dead letter</button></form>'
    )
    tables = model["tables"]
    return (
        f'<p class="mono">{esc(job_id)}</p><div class="actions">{actions}</div><dl class="facts">{facts}</dl>'
        f"<h2>Timeline</h2>{table('attempts', 'Attempts: one per lease epoch (renewals are not recorded)', v.ATTEMPT_COLUMNS, tables['attempts'])}"
        f"<h2>Dependencies</h2>{table('depends-on', 'Depends on', ('Job',), tables['depends-on'])}"
        f"{table('dependents', 'Depended on by', ('Job',), tables['dependents'])}"
    )
