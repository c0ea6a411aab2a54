"""Render ``--chaos-report`` JSON lines as the table in docs/reliability.md.

python -m tests.chaos.report /path/to/report.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = (
    "transport",
    "fault seconds",
    "faults injected by type",
    "turns submitted",
    "turns accepted",
    "turns completed",
    "stale effects refused",
    "superseded effects",
    "max depth / bound",
    "recovered in",
    "invariant violations",
    "seed",
)


def row(report: dict[str, object]) -> str:
    faults = report["faults"]
    assert isinstance(faults, dict)
    violations = report["violations"]
    assert isinstance(violations, list)
    cells = [
        str(report["transport"]),
        f"{report['duration_s']:g}",
        ", ".join(f"{kind} {count}" for kind, count in sorted(faults.items())),
        str(report["turns_submitted"]),
        str(report["turns_accepted"]),
        str(report["turns_completed"]),
        str(report["stale_effects_refused"]),
        str(report.get("superseded_effects", "")),
        f"{report['depth_max']} / {report['depth_bound']}",
        f"{report['recovered_in_s']} s",
        str(len(violations)),
        str(report["seed"]),
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> int:
    lines = [json.loads(line) for line in Path(argv[1]).read_text().splitlines() if line.strip()]
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for report in lines:
        print(row(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
