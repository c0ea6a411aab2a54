"""The signed envelope: what :func:`seal` writes, :func:`open_envelope` opens, and nothing else."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_dispatch.envelope import AgentTurnEnvelope, open_envelope, seal
from agent_dispatch.errors import PoisonEnvelope

refs = st.text(alphabet="abcXYZ019._:@/+=-", min_size=1, max_size=40)
envelopes = st.builds(
    AgentTurnEnvelope,
    job_id=refs,
    session_id=refs,
    kind=st.text(alphabet="abz09._-", min_size=1, max_size=20),
    payload_ref=refs,
    tenant=refs,
    priority=st.integers(-1000, 1000),
    deadline=st.none() | st.floats(0, 2e11, allow_nan=False),
    attempt=st.integers(0, 1000),
    enqueued_at=st.floats(0, 2e11, allow_nan=False),
)
keys = st.binary(min_size=16, max_size=64)


@given(envelope=envelopes, key=keys)
def test_a_sealed_envelope_opens_to_itself_and_only_with_its_key(
    envelope: AgentTurnEnvelope, key: bytes
) -> None:
    wire = seal(envelope, key)
    assert open_envelope(wire, key) == envelope
    with pytest.raises(PoisonEnvelope, match="signature"):
        open_envelope(wire, key + b"x")


@given(envelope=envelopes, key=keys)
def test_the_same_envelope_laid_out_another_way_still_opens(envelope: AgentTurnEnvelope, key: bytes) -> None:
    """Verified over its canonical form, not its bytes: whitespace and key order change nothing."""
    outer = json.loads(seal(envelope, key))
    relaid = json.dumps({"sig": outer["sig"], "env": outer["env"], "v": outer["v"]}, indent=1).encode()
    assert open_envelope(relaid, key) == envelope


@given(envelope=envelopes, key=keys, data=st.data())
def test_a_changed_byte_is_poison_or_the_same_envelope(
    envelope: AgentTurnEnvelope, key: bytes, data: st.DataObject
) -> None:
    wire = bytearray(seal(envelope, key))
    at = data.draw(st.integers(0, len(wire) - 1))
    wire[at] = data.draw(st.integers(0, 255).filter(lambda b: b != wire[at]))
    try:
        opened = open_envelope(bytes(wire), key)
    except PoisonEnvelope:
        return
    assert opened == envelope  # e.g. "1.50" for "1.5": the same canonical envelope
