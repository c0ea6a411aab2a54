"""Answers are served as pydantic's compiled JSON (``Answer.json_bytes``): the same document as
``Answer.body``, the dict the OpenAPI schemas and the direct CLI client use."""

from __future__ import annotations

import json
from datetime import UTC

from hypothesis import given, settings
from hypothesis import strategies as st

from agent_dispatch import jobs
from agent_dispatch.gateway._models import BatchResult, JobHandle, JobList, JobView
from agent_dispatch.gateway.service import view_json
from agent_dispatch.models import Outcome, WorkItem, WorkState

_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)
_stamp = st.datetimes().map(lambda d: d.isoformat() + "+00:00")
_view = st.fixed_dictionaries(
    {
        "job_id": _text,
        "tenant": _text,
        "kind": _text,
        "queue": _text,
        "session_id": _text,
        "state": st.sampled_from(["ready", "running", "succeeded", "dead_letter"]),
        "terminal": st.booleans(),
        "attempt": st.integers(0, 2**40),
        "max_attempts": st.integers(1, 100),
        "lease_epoch": st.integers(0, 2**62),
        "fencing_token": st.integers(0, 2**62),
        "lease_owner": st.none() | _text,
        "priority": st.integers(-(2**31), 2**31 - 1),
        "depends_on": st.lists(_text, max_size=3),
        "timestamps": st.fixed_dictionaries(
            {
                "created_at": _stamp,
                "updated_at": _stamp,
                "deadline": st.none() | _stamp,
                "lease_expires_at": st.none() | _stamp,
                "not_before": st.none() | _stamp,
            }
        ),
        "outcome": st.none() | st.sampled_from(["succeeded", "failed", "cancelled"]),
        "error": st.none() | _text,
    },
    optional={"changed": st.booleans()},
)


@settings(max_examples=200)
@given(views=st.lists(_view, max_size=3), after=st.none() | _text, created=st.booleans())
def test_the_served_json_is_the_body(
    views: list[dict[str, object]], after: str | None, created: bool
) -> None:
    answers = [JobView.model_validate(v) for v in views]
    answers.append(JobList(jobs=answers, next_after=after))  # type: ignore[arg-type]
    for view in views:
        handle = {k: view[k] for k in ("job_id", "session_id", "state")}
        answers.append(
            JobHandle.model_validate(
                handle | {"work_item_id": view["job_id"], "status_url": "/x", "created": created}
            )
        )
    answers.append(BatchResult.model_validate({"accepted": 0, "results": []}))
    for answer in answers:
        assert json.loads(answer.json_bytes()) == answer.body()


_when = st.none() | st.datetimes(timezones=st.just(UTC))
_item = st.builds(
    WorkItem,
    id=_text,
    tenant=_text,
    kind=_text,
    queue=_text,
    session_id=_text,
    state=st.sampled_from(WorkState),
    priority=st.integers(-(2**31), 2**31 - 1),
    deadline=_when,
    attempt=st.integers(0, 2**40),
    max_attempts=st.integers(1, 100),
    lease_epoch=st.integers(0, 2**62),
    fencing_token=st.integers(0, 2**62),
    lease_owner=st.none() | _text,
    lease_expires_at=_when,
    not_before=_when,
    idempotency_key=st.none() | _text,
    depends_on=st.lists(_text, max_size=3).map(tuple),
    created_at=st.datetimes(timezones=st.just(UTC)),
    updated_at=st.datetimes(timezones=st.just(UTC)),
    outcome=st.none() | st.sampled_from(Outcome),
    error=st.none() | _text,
)


@settings(max_examples=300)
@given(item=_item)
def test_a_status_answer_is_the_job_view_of_the_item(item: WorkItem) -> None:
    # The status read serves view_json without building a JobView: it must be that model's JSON.
    assert view_json(item) == JobView.model_validate(jobs.project(item)).json_bytes()
