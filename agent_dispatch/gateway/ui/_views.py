"""Each page's view model: the texts, table rows and chart series the page shows.

The server renders a page from its view model, and the page's script fetches the same model as
JSON every few seconds and writes it in place (``textContent`` only), so both paths show the same
thing and nothing from a payload or an error is ever parsed as HTML.
"""

from __future__ import annotations

from typing import Any, Final
from urllib.parse import quote

#: A table cell: its text, or ``[text, href]`` for a link.
Cell = str | list[str]

JOB_COLUMNS: Final = ("Job", "Tenant", "Kind", "Session", "State", "Attempt", "Created")
TENANT_COLUMNS: Final = ("Tenant", "Queued", "Running", "Done", "Oldest waiting", "Last served")
WORKER_COLUMNS: Final = ("Worker", "Heartbeat", "Renewed", "Age", "Lease duration", "Leases held")
LEASE_COLUMNS: Final = ("Worker", "Owner", "Job", "Tenant", "State", "Epoch", "Token", "Expires")
ATTEMPT_COLUMNS: Final = ("Epoch", "Token", "Owner", "Started", "Ended", "Outcome", "Error", "Events")


def _t(value: Any) -> str:
    return "—" if value is None or value == "" else str(value)


def job_link(job_id: str) -> list[str]:
    return [job_id, f"/ui/jobs/{quote(job_id, safe='')}"]


def overview(data: dict[str, Any]) -> dict[str, Any]:
    depth = data["depth"]
    bound = data["max_depth"]
    rates = data["rates_per_min"]
    totals = data["totals"]
    fields = {
        "depth": "unknown" if depth is None else f"{depth:,}",
        "bound": f"{bound:,}",
        "depth-pct": "" if depth is None else f"{100 * depth / bound:.1f}% of the bound",
        **{f"rate-{k}": f"{v:g}/min" for k, v in rates.items()},
        **{f"total-{k}": f"{v:,}" for k, v in totals.items()},
        # Not "workers"/"leases": those ids are the tables' (one id, one element).
        "worker-count": str(len(data["workers"])),
        "lease-count": str(data["leases_shown"]),
    }
    leases: list[list[Cell]] = [
        [
            w["worker"],
            lease["owner"],
            job_link(lease["job_id"]),
            lease["tenant"],
            lease["state"],
            str(lease["lease_epoch"]),
            str(lease["fencing_token"]),
            _t(lease["expires_at"]),
        ]
        for w in data["workers"]
        for lease in w["leases"]
    ]
    beats = data["heartbeats"]
    held = {w["worker"]: len(w["leases"]) for w in data["workers"]}
    seen = {b["worker"]: b for b in beats["workers"]}
    workers: list[list[Cell]] = []
    for name in sorted(set(held) | set(seen)):
        b = seen.get(name)
        workers.append(
            [
                name,
                "no Lease" if b is None else ("live" if b["live"] else "stale"),
                "—" if b is None else _t(b["renewed_at"]),
                "—" if b is None or b["age_s"] is None else f"{b['age_s']:.0f} s ago",
                "—" if b is None else f"{b['duration_s']} s",
                str(held.get(name, 0)),
            ]
        )
    fields["heartbeat-note"] = beats["note"]
    history = data["history"]
    chart = {
        "depth": [h["depth"] or 0 for h in history],
        "done": [h["succeeded"] + h["failed"] + h["dead_lettered"] for h in history],
        "admitted": [h["admitted"] for h in history],
    }
    return {
        "fields": fields,
        "tables": {"worker-heartbeats": workers, "leases": leases},
        "chart": chart,
        "hidden": {},
    }


def tenants(page: dict[str, Any], limit: str = "") -> dict[str, Any]:
    rows = page["tenants"]
    table: list[list[Cell]] = [
        [
            r["tenant"],
            f"{r['queued']:,}",
            f"{r['running']:,}",
            f"{r['done']:,}",
            _t(r["oldest_waiting"]),
            _t(r["last_served"]),
        ]
        for r in rows
    ]
    following = page["next_after"]
    return {
        "fields": {"tenant-count": str(len(rows))},
        "tables": {"tenants": table},
        "links": {
            "next-tenants": ""
            if following is None
            else f"?after={quote(following, safe='')}" + (f"&limit={quote(limit, safe='')}" if limit else "")
        },
        "hidden": {"next-tenants": following is None},
    }


def jobs(page: dict[str, Any], query: dict[str, str]) -> dict[str, Any]:
    table: list[list[Cell]] = [
        [
            job_link(j["job_id"]),
            j["tenant"],
            j["kind"],
            j["session_id"],
            j["state"],
            f"{j['attempt']}/{j['max_attempts']}",
            _t(j["timestamps"]["created_at"]),
        ]
        for j in page["jobs"]
    ]
    following = page["next_after"]
    nxt = (
        ""
        if following is None
        else "?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in {**query, "after": following}.items() if v)
    )
    return {
        "fields": {"job-count": str(len(table))},
        "tables": {"jobs": table},
        "links": {"next-page": nxt},
        "hidden": {"next-page": following is None, "no-jobs": bool(table)},
    }


def job(view: dict[str, Any]) -> dict[str, Any]:
    ts = view["timestamps"]
    fields = {
        "job-state": view["state"],
        "job-tenant": view["tenant"],
        "job-kind": view["kind"],
        "job-session": view["session_id"],
        "job-attempt": f"{view['attempt']}/{view['max_attempts']}",
        "job-epoch": str(view["lease_epoch"]),
        "job-token": str(view["fencing_token"]),
        "job-owner": _t(view["lease_owner"]),
        "job-priority": str(view["priority"]),
        "job-payload": f"{view['payload_size']:,} bytes",
        "job-created": _t(ts["created_at"]),
        "job-updated": _t(ts["updated_at"]),
        "job-deadline": _t(ts["deadline"]),
        "job-expires": _t(ts["lease_expires_at"]),
        "job-outcome": _t(view["outcome"]),
        "job-error": _t(view["error"]),
    }
    attempts: list[list[Cell]] = [
        [
            str(a["lease_epoch"]),
            str(a["fencing_token"]),
            _t(a["owner"]),
            _t(a["started_at"]),
            _t(a["ended_at"]),
            _t(a["outcome"]),
            _t(a["error"]),
            ", ".join(e["event"] for e in a["events"]),
        ]
        for a in view["timeline"]
    ]
    return {
        "fields": fields,
        "tables": {
            "attempts": attempts,
            "depends-on": [[job_link(d)] for d in view["depends_on"]],
            "dependents": [[job_link(d)] for d in view["dependents"]],
        },
        "hidden": {"cancel-form": not view["can_cancel"], "retry-form": not view["can_retry"]},
    }
