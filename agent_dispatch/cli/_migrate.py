"""``agent-dispatch migrate``: create or upgrade the WorkItem schema of the configured store."""

from __future__ import annotations

import argparse
import sys

from agent_dispatch.errors import BackendUnavailable
from agent_dispatch.settings import load_or_exit
from agent_dispatch.stores import open_store

EXIT_OK = 0
EXIT_UNAVAILABLE = 3


def run_migrate(args: argparse.Namespace) -> int:
    settings = load_or_exit("agent-dispatch migrate")
    backend = "postgres" if settings.state_db_uri is not None else "sqlite"
    try:
        store = open_store(settings)
        try:
            version = store.migrate()
        finally:
            store.close()
    except BackendUnavailable as exc:
        # The message names the backend, never the URI (it may carry a password).
        print(f"agent-dispatch migrate: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    print(f"agent-dispatch migrate: WorkItem schema on {backend} is at version {version}")
    return EXIT_OK
