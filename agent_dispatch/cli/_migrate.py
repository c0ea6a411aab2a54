"""``agent-dispatch migrate``: create or upgrade the WorkItem schema of the configured store."""

from __future__ import annotations

import argparse
import sys

from agent_dispatch.errors import DispatchError
from agent_dispatch.runtime import EXIT_OK, StartupError, open_store, startup_error
from agent_dispatch.settings import load_or_exit


def run_migrate(args: argparse.Namespace) -> int:
    settings = load_or_exit("agent-dispatch migrate")
    backend = "postgres" if settings.state_db_uri is not None else "sqlite"
    try:
        store = open_store(settings)
    except StartupError as exc:
        # The message names the backend, never the URI (it may carry a password).
        print(f"agent-dispatch migrate: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        version = store.migrate()
    except DispatchError as exc:
        failure = startup_error(exc)
        print(f"agent-dispatch migrate: {failure}", file=sys.stderr)
        return failure.exit_code
    finally:
        store.close()
    print(f"agent-dispatch migrate: WorkItem schema on {backend} is at version {version}")
    return EXIT_OK
