"""The store's statements, rendered once from ``sql/statements.sql`` (the SQL lives there).

Python only picks the variants: which filters a claim carries, whether a statement is the
single-statement fast form (``NOT has_dependents``), and whether a commit serves one lease
(named parameters) or a batch (the columns of unnested arrays).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from agent_dispatch.db import sql
from agent_dispatch.stores._common import ITEM_COLUMNS, ITEM_SELECT, OUTCOME_SELECT

_SQL: Final = sql.load(__package__ or "agent_dispatch.stores.postgres", "sql/statements.sql")

T: Final = "agent_dispatch_work_items"

_FRAGMENTS: Final = {
    "item": ITEM_SELECT,
    "outcome_cols": OUTCOME_SELECT,
    "return_item": ITEM_SELECT + ", has_dependents",
    "return_w": ", ".join(f"w.{c}" for c in ITEM_COLUMNS) + ", w.has_dependents",
    "now": _SQL["now"],
    "active": _SQL["active"],
    "non_terminal": _SQL["non_terminal"],
}


def render(name: str, **fields: Any) -> str:
    """Section ``name`` with the shared fragments and ``fields`` filled in."""
    return _SQL[name].format(**_FRAGMENTS, **fields)


NOW: Final = _FRAGMENTS["now"]
NO_DEPENDENTS: Final = _SQL["no_dependents"]
NO_CASCADE: Final = _SQL["no_cascade"]
_CLAIMABLE: Final = render("claimable")


def _param(name: str) -> str:
    """A value of the one request a statement serves: its named parameter."""
    return f"%({name})s"


def _column(name: str) -> str:
    """A value of one request of a batch: its column of the unnested arrays (``commit_batch``)."""
    return f"c_{name}"


def fence_sql(arg: Callable[[str], str] = _param) -> str:
    """The fence condition; ``arg`` names where the lease's fields come from."""
    return render("fence", **{f: arg(f) for f in ("id", "tenant", "owner", "epoch", "token")})


def event_sql(event: str, outcome: str = "NULL", detail: str = "NULL", owner: str = "lease_owner") -> str:
    """An INSERT of one provenance record per row of the ``upd`` CTE (for ``WITH ... ev AS (...)``)."""
    return render("event", select=_event_select(event, outcome, detail, owner))


def _event_select(event: str, outcome: str = "NULL", detail: str = "NULL", owner: str = "lease_owner") -> str:
    return render("event_select", event=event, outcome=outcome, detail=detail, owner=owner)


def _take(leased: str = "leased", returning: str = "", *, named: str = "") -> str:
    """``named``: the fragment naming the rows (``take_named``, ``take_named_one``), if any."""
    return render("take", leased=leased, returning=returning, named=_SQL[named] if named else "")


def _take_event(leased: str = "leased", then: str = "") -> str:
    return render("take_event", leased=leased, then=then)


def claim_next_sql(*, queue: bool, tenant: bool) -> str:
    """The claim of the next item; a text per filter, each with its plan."""
    filters = (_SQL["filter_queue"] if queue else "") + (_SQL["filter_tenant"] if tenant else "")
    return render("claim_next", claimable=_CLAIMABLE, filters=filters, take=_take(), take_event=_take_event())


def claim_named_sql(*, fast: bool) -> str:
    simple = "(attempt < max_attempts OR NOT has_dependents)" if fast else "true"
    return render("claim_named", simple=simple, claimable=_CLAIMABLE, take=_take(), take_event=_take_event())


def commit_sql(extra: str = "", *, batch: bool = False) -> str:
    """The fenced terminal commit of one lease, or (``batch``) of every lease in the arrays."""
    arg = _column if batch else _param
    where = render("commit_batch" if batch else "commit_one", fence=fence_sql(arg), extra=extra)
    return render(
        "commit",
        state=arg("state"),
        outcome=arg("outcome"),
        error=arg("error"),
        where=where,
        event=event_sql("'commit'", "outcome", "error"),
    )


def retry_sql(extra: str = "") -> str:
    event = event_sql(
        "CASE WHEN state = 'ready' THEN 'retry' ELSE 'dead_letter' END", "outcome", "error", "%(owner)s"
    )
    return render("retry", fence=FENCE, extra=extra, event=event)


FENCE: Final = fence_sql()
SELECT_VIEW: Final = render("select_view")
SELECT_ITEM: Final = render("select_item")
SELECT_ITEMS: Final = render("select_items")
SELECT_BY_KEY: Final = render("select_by_key")
SELECT_BY_ID_FOR_SUBMIT: Final = render("select_by_id_for_submit")
LOCK_DEPENDENCIES: Final = render("lock_dependencies")
INSERT_ITEM: Final = render("insert_item")
INSERT_MANY: Final = render("insert_many")
INSERT_DEPENDENCIES: Final = render("insert_dependencies")
CLAIM_NEXT: Final = {(q, t): claim_next_sql(queue=q, tenant=t) for q in (False, True) for t in (False, True)}
CLAIM_NAMED: Final = claim_named_sql(fast=False)
CLAIM_NAMED_FAST: Final = claim_named_sql(fast=True)
MARK_RUNNING: Final = render("mark_running", fence=FENCE, event=event_sql("'running'"))
START_MANY, START_ONE = (
    render(
        name,
        claimable=_CLAIMABLE,
        take=_take("running", ", w.payload", named=named),
        take_event=_take_event("running", " UNION ALL " + _event_select("'running'")),
    )
    for name, named in (("start_many", "take_named"), ("start_one", "take_named_one"))
)
RENEW: Final = render("renew", fence=FENCE)
COMMIT: Final = commit_sql()
COMMIT_FAST: Final = commit_sql(NO_DEPENDENTS)
COMMIT_MANY: Final = commit_sql(NO_DEPENDENTS, batch=True)
RETRY: Final = retry_sql()
RETRY_FAST: Final = retry_sql(NO_CASCADE)
DEFER: Final = render(
    "defer", fence=FENCE, event=event_sql("'defer'", detail="%(detail)s", owner="%(owner)s")
)
CANCEL: Final = render("cancel", event=event_sql("'cancel'", "outcome", "error"))
DEAD_LETTER: Final = render("dead_letter", event=event_sql("'dead_letter'", detail="error"))
EXPIRE: Final = render("expire", event=event_sql("'expire'", "outcome", "error"))
CASCADE: Final = render("cascade", event=event_sql("'cancel'", "outcome", "error"))
RELEASE: Final = render("release")
RECOVERABLE: Final = render("recoverable")
MARK_DISPATCHED: Final = render("mark_dispatched")
SELECT_OUTCOMES: Final = render("select_outcomes")
SELECT_PAYLOAD: Final = render("select_payload")
SELECT_NOW: Final = render("select_now")


def list_items_sql(*, states: bool, after: bool) -> str:
    where = (
        [_SQL["list_tenant"]]
        + ([_SQL["list_states"]] if states else [])
        + ([render("list_after")] if after else [])
    )
    return render("list_items", where=" AND ".join(where))
