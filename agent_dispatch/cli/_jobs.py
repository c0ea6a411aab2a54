"""``agent-dispatch jobs status (or show) | cancel | list | watch``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from agent_dispatch.models import TERMINAL as _TERMINAL_STATES
from agent_dispatch.models import WorkState

STATES = tuple(s.value for s in WorkState)
TERMINAL = frozenset(s.value for s in _TERMINAL_STATES)
ACTIVE = tuple(s for s in STATES if s not in TERMINAL)


def register(sub: Any) -> None:
    from agent_dispatch.cli._client import add_target_options

    parser = sub.add_parser(
        "jobs",
        help="show, list, watch or cancel jobs",
        description="Jobs of one tenant, through a gateway (--url) or the configured store. Exit 0 on "
        "success, 1 for a missing job or (watch) a job that did not succeed, 3 when unreachable.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    status = actions.add_parser("status", aliases=["show"], help="print a job's status as JSON (alias: show)")
    status.add_argument("job_id")
    cancel = actions.add_parser("cancel", help="cancel a job (a running turn stops at its next side effect)")
    cancel.add_argument("job_id")
    listing = actions.add_parser("list", help="list jobs, newest first")
    listing.add_argument(
        "--state", action="append", default=[], choices=STATES, help="only this state (repeatable)"
    )
    listing.add_argument("--limit", type=int, default=50, help="page size, 1 to 1000 (default: 50)")
    listing.add_argument("--after", metavar="JOB_ID", help="the next page after this job (next_after)")
    listing.add_argument("--json", action="store_true", help="print the page as JSON")
    watch = actions.add_parser("watch", help="live progress of jobs until all have finished")
    watch.add_argument("job_ids", nargs="*", metavar="JOB_ID", help="jobs to watch (default: all unfinished)")
    watch.add_argument("--interval", type=float, default=1.0, metavar="S", help="refresh every S seconds")
    watch.add_argument(
        "--timeout", type=float, default=0.0, metavar="S", help="give up after S seconds (0: never)"
    )
    for action in (status, cancel, listing, watch):
        add_target_options(action)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from agent_dispatch.cli._client import JobsClient, run_with_client
    from agent_dispatch.runtime import EXIT_OK, EXIT_USAGE
    from agent_dispatch.settings import load_or_exit

    settings = load_or_exit(f"agent-dispatch jobs {args.action}")
    if args.action == "list" and not 1 <= args.limit <= 1000:
        print("agent-dispatch jobs list: invalid option --limit: allowed: 1 to 1000", file=sys.stderr)
        return EXIT_USAGE

    def act(client: JobsClient) -> int:
        if args.action in {"status", "show"}:
            print(json.dumps(client.status(args.job_id), indent=2))
        elif args.action == "cancel":
            print(json.dumps(client.cancel(args.job_id), indent=2))
        elif args.action == "list":
            page = client.list(states=args.state, limit=args.limit, after=args.after)
            if args.json:
                print(json.dumps(page, indent=2))
            else:
                print_table(page["jobs"], sys.stdout)
                if page.get("next_after"):
                    print(f"more: --after {page['next_after']}")
        else:
            return watch(client, args.job_ids, interval_s=args.interval, timeout_s=args.timeout)
        return EXIT_OK

    return run_with_client(settings, args, f"jobs {args.action}", act)


def _row(job: dict[str, Any]) -> list[str]:
    attempts = f"{job.get('attempt', '?')}/{job.get('max_attempts', '?')}"
    return [
        str(job.get("job_id", "")),
        str(job.get("state", "")),
        attempts,
        str(job.get("lease_epoch", "")),
        str(job.get("timestamps", {}).get("updated_at") or "")[:19],
        str(job.get("error") or ""),
    ]


def print_table(jobs: Sequence[dict[str, Any]], out: TextIO) -> None:
    header = ["JOB", "STATE", "ATTEMPT", "EPOCH", "UPDATED", "ERROR"]
    rows = [header, *(_row(j) for j in jobs)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n")
    out.flush()


def watch(client: Any, job_ids: Sequence[str], *, interval_s: float, timeout_s: float) -> int:
    """Refresh a table on a terminal; elsewhere print one line per state change. 0 if all succeeded."""
    from agent_dispatch.runtime import EXIT_FAILURE, EXIT_OK

    ids = list(dict.fromkeys(job_ids))
    if not ids:
        page = client.list(states=ACTIVE, limit=1000)
        ids = [job["job_id"] for job in page["jobs"]]
        if not ids:
            print("no unfinished jobs")
            return EXIT_OK
    tty = sys.stdout.isatty()
    seen: dict[str, str] = {}
    started = time.monotonic()
    while True:
        views = {job_id: client.status(job_id) for job_id in ids}
        if tty:
            # Home the cursor and clear: a simple full redraw, no curses needed.
            sys.stdout.write("\x1b[H\x1b[2J")
            print_table(list(views.values()), sys.stdout)
            done = sum(1 for v in views.values() if v.get("state") in TERMINAL)
            print(f"{done}/{len(ids)} finished  ({time.monotonic() - started:.0f}s)", flush=True)
        else:
            for job_id, view in views.items():
                state = str(view.get("state"))
                if seen.get(job_id) != state:
                    seen[job_id] = state
                    print(f"{job_id} {state} attempt={view.get('attempt')}", flush=True)
        if all(v.get("state") in TERMINAL for v in views.values()):
            break
        if timeout_s and time.monotonic() - started >= timeout_s:
            print(f"timed out after {timeout_s:g}s", file=sys.stderr)
            return EXIT_FAILURE
        time.sleep(interval_s)
    counts: dict[str, int] = {}
    for view in views.values():
        counts[str(view.get("state"))] = counts.get(str(view.get("state")), 0) + 1
    print(", ".join(f"{n} {state}" for state, n in sorted(counts.items())), flush=True)
    return EXIT_OK if counts.get("succeeded", 0) == len(ids) else EXIT_FAILURE
