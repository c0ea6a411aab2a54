"""``agent-dispatch submit``: one turn, to a gateway (``--url``) or straight into the configured store."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: Any) -> None:
    from agent_dispatch.cli._client import add_target_options

    parser = sub.add_parser(
        "submit",
        help="submit an agent turn",
        description="Submit one agent turn and print its job handle as JSON. Exit 0 when accepted "
        "(with --wait: when it succeeded), 1 when refused or the turn did not succeed, 2 for a bad "
        "request, 3 when the gateway or store is unreachable.",
    )
    parser.add_argument("--kind", default="turn", help="turn kind for the executor (default: turn)")
    parser.add_argument(
        "--payload",
        default="{}",
        metavar="JSON|@FILE|-",
        help="the payload: a JSON value, @path to read it from a file, or - for standard input (default: {})",
    )
    parser.add_argument(
        "--session", dest="session_id", metavar="ID", help="session id (turns of one session run in order)"
    )
    parser.add_argument("--priority", type=int, default=0, help="-1000 to 1000 (default: 0)")
    parser.add_argument("--deadline", metavar="WHEN", help="RFC 3339 timestamp, or seconds from now")
    parser.add_argument(
        "--depends-on",
        action="append",
        default=[],
        metavar="JOB_ID",
        help="a job that must succeed first (repeatable)",
    )
    parser.add_argument(
        "--max-attempts", type=int, metavar="N", help="attempts before dead_letter (1 to 100)"
    )
    parser.add_argument(
        "--idempotency-key", metavar="KEY", help="resubmitting with the same key returns the same job"
    )
    parser.add_argument(
        "--wait",
        action="store_true",
        help="wait until the job finishes; print its final status (one JSON document) instead of the handle",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, metavar="S", help="--wait gives up after S seconds"
    )
    add_target_options(parser)
    parser.set_defaults(handler=run)


def _payload(text: str) -> Any:
    if text == "-":
        text = sys.stdin.read()
    elif text.startswith("@"):
        with open(text[1:], encoding="utf-8") as source:
            text = source.read()
    return json.loads(text)


def _deadline(text: str | None) -> float | str | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return text


def run(args: argparse.Namespace) -> int:
    from agent_dispatch.cli._client import JobsClient, run_with_client, wait_terminal
    from agent_dispatch.runtime import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
    from agent_dispatch.settings import load_or_exit

    settings = load_or_exit("agent-dispatch submit")
    try:
        payload = _payload(args.payload)
    except (OSError, ValueError) as exc:
        print(f"agent-dispatch submit: invalid --payload: {exc}", file=sys.stderr)
        return EXIT_USAGE
    turn: dict[str, Any] = {"kind": args.kind, "payload": payload, "priority": args.priority}
    for key, value in {
        "session_id": args.session_id,
        "deadline": _deadline(args.deadline),
        "depends_on": args.depends_on or None,
        "max_attempts": args.max_attempts,
    }.items():
        if value is not None:
            turn[key] = value

    def act(client: JobsClient) -> int:
        handle = client.submit(turn, idempotency_key=args.idempotency_key)
        if not args.wait:
            print(json.dumps(handle, indent=2), flush=True)
            return EXIT_OK
        # stdout stays one JSON document (scripts parse it); the wait is progress, on stderr.
        verb = "accepted" if handle.get("created", True) else "already had"
        print(
            f"agent-dispatch submit: {verb} job {handle['job_id']}; waiting up to {args.timeout:g} s",
            file=sys.stderr,
            flush=True,
        )
        final = wait_terminal(client, handle["job_id"], timeout_s=args.timeout)
        print(json.dumps({**handle, **final}, indent=2), flush=True)
        return EXIT_OK if final.get("state") == "succeeded" else EXIT_FAILURE

    return run_with_client(settings, args, "submit", act)
