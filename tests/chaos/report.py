"""Render ``--chaos-report`` JSON lines as the table in docs/reliability.md.

python -m tests.chaos.report /path/to/report.jsonl

Two tables: a row per run, then a row per fault type of each run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

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
        f"{report['depth_max']} / {report['depth_bound']}"
        + (f" (unfinished {report['unfinished_max']})" if "unfinished_max" in report else ""),
        f"{report['recovered_in_s']} s",
        str(len(violations)),
        str(report["seed"]),
    ]
    return "| " + " | ".join(cells) + " |"


FAULT_COLUMNS = ("transport", "fault", "injected", "down or paused", "took (fault to all back)", "seed")


def _span(values: list[float]) -> str:
    return f"{min(values):g}-{max(values):g} s" if values else "-"


def fault_rows(report: dict[str, Any]) -> list[str]:
    """One row per fault type of a run: how often, how long the component was away, how long the
    fault took until everything it stopped served again (from the run's fault log)."""
    log = report.get("fault_log") or []
    rows = []
    for kind in sorted({entry["fault"] for entry in log}):
        entries = [e for e in log if e["fault"] == kind]
        down = [float(e[k]) for e in entries for k in ("down_s", "pause_s") if k in e]
        took = [float(e["took_s"]) for e in entries if "took_s" in e]
        cells = [
            str(report["transport"]),
            kind,
            str(len(entries)),
            _span(down),
            _span(took),
            str(report["seed"]),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str]) -> int:
    lines = [json.loads(line) for line in Path(argv[1]).read_text().splitlines() if line.strip()]
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for report in lines:
        print(row(report))
    print()
    print("| " + " | ".join(FAULT_COLUMNS) + " |")
    print("|" + "---|" * len(FAULT_COLUMNS))
    for report in lines:
        for line in fault_rows(report):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
