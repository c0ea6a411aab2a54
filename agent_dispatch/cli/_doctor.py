"""``agent-dispatch doctor``: a readable table, or ``--json``."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from agent_dispatch import doctor
from agent_dispatch.settings import Settings, load_or_exit

_MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL"}


def run_doctor(args: argparse.Namespace) -> int:
    settings = load_or_exit("agent-dispatch doctor")
    _redact_logs(settings)
    checks = doctor.run(settings, doctor.LIVE_PROBES)
    status = doctor.overall(checks)
    if args.json:
        print(json.dumps({"status": status, "checks": [c.as_dict() for c in checks]}, indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for check in checks:
            print(f"{check.name:<{width}}  {_MARK[check.status]:<4}  {check.detail}")
            if check.name == "settings":
                for key, value in check.data.items():
                    print(f"{'':<{width}}        {key} = {value}")
        print(f"overall: {status}")
    return doctor.exit_code(checks)


class _Redacting(logging.Filter):
    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = settings

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = doctor.redact(record.getMessage(), self.settings)
        record.args = None
        record.exc_info = record.exc_text = None
        return True


def _redact_logs(settings: Settings) -> None:
    """Drivers log their own connection errors (host names included): those go through redaction too."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.addFilter(_Redacting(settings))
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
