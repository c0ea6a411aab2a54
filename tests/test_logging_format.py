"""The JSON log line keeps a record's extra fields, except kopf's per-record settings dump."""

from __future__ import annotations

import json
import logging

from hypothesis import given
from hypothesis import strategies as st

from agent_dispatch._logging import JsonFormatter


@given(
    extra=st.dictionaries(
        st.from_regex(r"\Ax_[a-z]{1,8}\Z"), st.integers() | st.text(max_size=20), max_size=5
    )
)
def test_extras_are_kept_and_kopfs_settings_dropped(extra: dict[str, object]) -> None:
    record = logging.makeLogRecord(
        {"msg": "Timer 'refresh-status' succeeded.", "settings": "x" * 2000, **extra}
    )
    line = json.loads(JsonFormatter().format(record))
    assert "settings" not in line
    assert line["msg"] == "Timer 'refresh-status' succeeded."
    assert {k: line[k] for k in extra} == extra
