"""The Kafka transport's pure bookkeeping, without a broker: commit positions, metadata, receipts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_dispatch.errors import Fenced
from agent_dispatch.transports.kafka._bookkeeping import (
    META_MAX_CHARS,
    PartitionState,
    Prior,
    Slot,
    SlotState,
    Token,
    offset_ranges,
)


def _state(delivered: list[int], acked: set[int]) -> PartitionState:
    state = PartitionState(epoch=1)
    for offset in delivered:
        state.max_seen = offset
        state.order.append(offset)
        if offset not in acked:
            state.unacked[offset] = Slot(owner="w", state=SlotState.HELD, deliveries=1, deadline=0.0)
    return state


@given(st.lists(st.integers(0, 500), unique=True).map(sorted), st.data())
def test_commit_position_is_the_first_unacknowledged_offset(
    delivered: list[int], data: st.DataObject
) -> None:
    acked = set(data.draw(st.lists(st.sampled_from(delivered), unique=True))) if delivered else set()
    state = _state(delivered, acked)
    position = state.commit_position()
    unacked = [o for o in delivered if o not in acked]
    if not delivered:
        assert position is None
    elif unacked:
        assert position == unacked[0]  # never past an unacknowledged turn
    else:
        assert position == delivered[-1] + 1


@given(st.lists(st.integers(0, 10_000), unique=True).map(sorted))
def test_ranges_round_trip_through_commit_metadata(offsets: list[int]) -> None:
    text = f"ad1;d={max(offsets, default=0)};u={offset_ranges(offsets)}"
    prior = Prior.parse(text)
    assert prior is not None
    assert prior.unacked == frozenset(offsets)


def test_metadata_falls_back_to_unknown_when_too_long() -> None:
    delivered = list(range(0, 20_000, 2))  # every other offset unacknowledged: thousands of ranges
    state = _state(delivered, acked=set())
    text = state.commit_metadata()
    assert len(text) <= META_MAX_CHARS
    prior = Prior.parse(text)
    assert prior is not None and prior.unacked is None and prior.delivered_through == delivered[-1]


@pytest.mark.parametrize(
    "text", [None, "", "something else", "ad1;", "ad1;d=x;u=1", "ad1;d=5;u=3-x", "ad2;d=1;u="]
)
def test_foreign_or_damaged_metadata_is_ignored(text: str | None) -> None:
    assert Prior.parse(text) is None


@pytest.mark.parametrize("token", ["", "kafka1", "kafka1:a:b:c:d:e", "pg:1:2:3:4:5", "kafka1:x:1:2:3"])
def test_malformed_receipts_are_fenced(token: str) -> None:
    with pytest.raises(Fenced):
        Token.decode(token)


def test_receipt_tokens_round_trip() -> None:
    token = Token("7f.3", partition=2, offset=41, epoch=9, delivery=2)
    assert Token.decode(token.encode()) == token
