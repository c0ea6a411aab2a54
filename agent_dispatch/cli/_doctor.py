"""``agent-dispatch doctor``: a readable table, or ``--json``."""

from __future__ import annotations

import argparse
import json

from agent_dispatch import doctor
from agent_dispatch.settings import load_or_exit

_MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL"}


def run_doctor(args: argparse.Namespace) -> int:
    settings = load_or_exit("agent-dispatch doctor")
    checks = doctor.run(settings)
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
    return 1 if status == "fail" else 0
