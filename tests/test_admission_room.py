"""The one-transaction admission's pre-check is skipped while the queue was just seen at most half
full (a round trip of a one-turn submit's six), and taken by every request near the bound; which
requests are accepted does not change, since the admission in the transaction is the bound."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_dispatch import dispatch
from agent_dispatch.errors import NotFound, QueueFull
from agent_dispatch.models import Outcome, deterministic_id
from agent_dispatch.settings import Settings
from agent_dispatch.stores.sqlite import SqliteStore
from agent_dispatch.transports.sqlite import SqliteTransport
from tests.test_dispatch import KEY, LAYOUTS, Layout, make_layout, request_for

__all__ = ["make_layout"]  # the fixture, used by name

SHARED = [p for p in LAYOUTS if "shared" in str(p.values[0])]


def _admission(layout: Layout) -> Any:
    admission = dispatch.choose_admission(
        layout.store, layout.transport, signing_key=KEY, settings=layout.settings
    )
    assert isinstance(admission, dispatch.OneTransaction)
    return admission


def _count_probes(layout: Layout) -> list[int]:
    """The depth each pre-check read, in order."""
    real = layout.transport.depth
    seen: list[int] = []

    def depth() -> int:
        seen.append(real())
        return seen[-1]

    layout.transport.depth = depth
    return seen


@pytest.mark.parametrize("make_layout", SHARED, indirect=True)
def test_a_queue_seen_half_empty_is_not_asked_again_at_once(make_layout: Callable[..., Layout]) -> None:
    layout = make_layout(max_depth=100)
    admission, probes = _admission(layout), _count_probes(layout)
    for i in range(10):
        assert admission.enqueue(request_for(f"k{i}")).created
    assert admission.enqueue_many([request_for(f"b{i}") for i in range(5)])
    assert probes == [0]
    assert layout.transport.depth() == 15


@pytest.mark.parametrize("make_layout", SHARED, indirect=True)
def test_near_the_bound_every_request_asks(make_layout: Callable[..., Layout]) -> None:
    layout = make_layout(max_depth=4)
    admission = _admission(layout)
    for i in range(2):
        assert admission.enqueue(request_for(f"k{i}")).created
    probes = _count_probes(layout)
    admission._room_until = 0.0  # the moment has passed
    assert admission.enqueue(request_for("k2")).created
    assert admission.enqueue(request_for("k3")).created
    with pytest.raises(QueueFull, match="at the bound 4"):  # the pre-check's refusal
        admission.enqueue(request_for("k4"))
    assert probes == [2, 3, 4]


@settings(max_examples=25, deadline=None)
@given(
    bound=st.integers(min_value=1, max_value=6),
    steps=st.lists(st.sampled_from(["new", "replay", "finish"]), min_size=1, max_size=25),
)
def test_accepted_turns_never_pass_the_bound(bound: int, steps: list[str]) -> None:
    """Against a model that counts the unfinished turns (SQLite, one file per example): a new turn
    is accepted exactly while there is room, a refused one leaves nothing stored, a replay is
    always answered, and a finished turn makes room."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "agent-dispatch.sqlite3"
        config = Settings(max_depth=bound, signing_key=KEY.decode(), data_dir=Path(tmp))
        store = SqliteStore(path, config)
        transport = SqliteTransport(path, max_depth=bound, visibility_timeout_s=60)
        try:
            store.migrate()
            transport.ensure_ready()
            admission = dispatch.choose_admission(store, transport, signing_key=KEY, settings=config)
            assert isinstance(admission, dispatch.OneTransaction)
            queued: list[str] = []
            for n, step in enumerate(steps):
                if step == "finish" and queued:
                    (delivery,) = transport.claim("w", max_items=1)
                    lease = store.claim("w", work_item_id=delivery.work_item_id)
                    assert lease is not None
                    store.commit(lease, Outcome.SUCCEEDED)
                    transport.ack_many([delivery.receipt])
                    queued = [k for k in queued if deterministic_id("tenant-a", k) != delivery.work_item_id]
                elif step == "replay" and queued:
                    assert not admission.enqueue(request_for(queued[0])).created
                elif len(queued) < bound:
                    assert admission.enqueue(request_for(f"k{n}")).created
                    queued.append(f"k{n}")
                else:
                    with pytest.raises(QueueFull):
                        admission.enqueue(request_for(f"k{n}"))
                    with pytest.raises(NotFound):
                        store.get(deterministic_id("tenant-a", f"k{n}"))
                assert transport.depth() == len(queued) == store.unfinished()
        finally:
            transport.close()
            store.close()
