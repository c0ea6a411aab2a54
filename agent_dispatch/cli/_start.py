"""How the serving commands (``gateway``, ``worker``, ``up``) are registered and start: their shared
options and the first steps of their run (settings, the options' ranges, logging), written once
so the three cannot drift apart in an option, a message, a range or an exit code.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any, Final

from agent_dispatch import _logging
from agent_dispatch.runtime import EXIT_USAGE
from agent_dispatch.settings import Settings, load_or_exit

#: What a serving command does once its settings are loaded, its options checked and logging set up.
Serve = Callable[[argparse.Namespace, Settings], int]
#: A reason the command cannot run with these settings (one line), or None.
Refuse = Callable[[Settings], str | None]

#: The numeric options' allowed ranges, by argparse ``dest``, in the order they are checked.
#: Checked after the settings load, not by argparse, so that a bad setting is reported first.
RANGES: Final[dict[str, tuple[int, int]]] = {"port": (0, 65535), "concurrency": (1, 256)}


def add_serving_command(
    sub: Any,
    name: str,
    serve: Serve,
    *,
    summary: str,
    description: str,
    listen: bool = False,
    concurrency: bool = False,
    refuse: Refuse | None = None,
    quiet: bool = False,
) -> argparse.ArgumentParser:
    """Register ``agent-dispatch NAME``: ``listen`` adds ``--host``/``--port``, ``concurrency``
    adds ``-c/--concurrency``; the handler runs :func:`start`, then ``serve``. Returns the parser
    for the command's own options."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=summary, description=description)
    if listen:
        parser.add_argument("--host", help="listen address (default: AGENT_DISPATCH_GATEWAY_HOST, 127.0.0.1)")
        parser.add_argument(
            "--port",
            type=int,
            help="listen port (default: AGENT_DISPATCH_GATEWAY_PORT, 8080; 0: any free port)",
        )
    if concurrency:
        parser.add_argument(
            "-c",
            "--concurrency",
            type=int,
            metavar="N",
            help="worker threads (default: AGENT_DISPATCH_CONCURRENCY)",
        )
    program = f"agent-dispatch {name}"
    parser.set_defaults(handler=functools.partial(start, program, serve, refuse=refuse, quiet=quiet))
    return parser


def start(
    program: str,
    serve: Serve,
    args: argparse.Namespace,
    *,
    refuse: Refuse | None = None,
    quiet: bool = False,
) -> int:
    """Load the settings (exit 2 on a bad one), check the numeric options, set up logging, serve.

    Settings come first: a bad value must be the only line printed, before anything else starts.
    ``refuse`` is checked before the options, so it is the one reported when both are wrong.
    ``quiet`` is for interactive commands: warnings only, as text, unless the log settings are
    given. A refusal or an option out of range is one line and EXIT_USAGE.
    """
    settings = load_or_exit(program)
    problem = refuse(settings) if refuse is not None else None
    if problem is None:
        problem = _out_of_range(args)
    if problem is not None:
        print(f"{program}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    fields = settings.model_fields_set
    level = settings.log_level if not quiet or "log_level" in fields else "WARNING"
    fmt = settings.log_format.value if not quiet or "log_format" in fields else "text"
    _logging.configure(level, fmt)
    return serve(args, settings)


def _out_of_range(args: argparse.Namespace) -> str | None:
    for dest, (low, high) in RANGES.items():
        value = getattr(args, dest, None)
        if value is not None and not low <= value <= high:
            return f"invalid option --{dest}: allowed: {low} to {high}"
    return None
