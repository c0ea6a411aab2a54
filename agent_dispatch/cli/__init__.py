"""The ``agent-dispatch`` command line.

Exit codes (one rule for every command, :mod:`agent_dispatch.runtime`): 0 success; 1 the command
ran and found a failure (a failed doctor check, a job that failed); 2 bad usage or an invalid
setting (one line names it); 3 a required service is unreachable; 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from agent_dispatch.cli import _gateway, _jobs, _submit, _up, _worker
from agent_dispatch.k8s_names import add_namespace_scope
from agent_dispatch.metrics_api._run import register as register_metrics_api
from agent_dispatch.runtime import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    StartupError,
)

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "build_parser",
    "main",
    "operator_main",
    "worker_main",
]

Handler = Callable[[argparse.Namespace], int]


def _doctor_command(args: argparse.Namespace) -> int:
    from agent_dispatch.cli._doctor import run_doctor

    return run_doctor(args)


def _run_migrate(args: argparse.Namespace) -> int:
    # Not named ``_migrate``: importing the submodule of that name would rebind it on this package.
    from agent_dispatch.cli._migrate import run_migrate

    return run_migrate(args)


def _operator(args: argparse.Namespace) -> int:
    from agent_dispatch.operator._run import main as run_operator

    return run_operator(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agent-dispatch",
        description="Queue-driven dispatcher for AI-agent turns with fenced leases.",
        epilog="Exit codes: 0 ok, 1 failure found, 2 bad usage or setting, 3 service unreachable, 130 interrupted.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    doctor = sub.add_parser("doctor", help="check settings, lease recovery, transport and schema")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(handler=_doctor_command)

    for module in (_up, _submit, _jobs, _gateway):
        module.register(sub)

    _worker.register(sub)

    sub.add_parser("migrate", help="create or upgrade the WorkItem and queue schema").set_defaults(
        handler=_run_migrate
    )

    operator = sub.add_parser(
        "operator", help="run the Kubernetes operator (same as agent-dispatch-operator)"
    )
    add_namespace_scope(
        operator,
        each="watch this namespace (repeatable; glob patterns allowed)",
        every="watch every namespace (the default when no --namespace is given)",
    )
    operator.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        metavar="URL",
        help="serve the liveness endpoint at URL ('' disables it)",
    )
    operator.set_defaults(handler=_operator)

    register_metrics_api(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except StartupError as exc:  # a handler that let one through still exits by the one rule
        print(f"agent-dispatch {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    return code


def worker_main() -> int:
    return main(["worker", *sys.argv[1:]])


def operator_main() -> int:
    return main(["operator", *sys.argv[1:]])
