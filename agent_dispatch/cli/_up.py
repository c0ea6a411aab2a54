"""``agent-dispatch up``: the whole system on one machine, no servers (SQLite in the data directory).

Gateway and workers in one process: migrates the schema, generates the signing key and a
token for tenant ``local`` (stored hashed; the plaintext is printed once), prints a sample
request, runs a demo turn end to end, and serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import socket
import sys
import time
from typing import Any

from agent_dispatch.cli._start import add_serving_command
from agent_dispatch.settings import Backend, Settings

DEMO_TIMEOUT_S = 60.0
LOCAL_TENANT = "local"
#: The web UI administrator `up` makes (a fresh token each run, like the tenant's).
LOCAL_ADMIN = "admin"


def register(sub: Any) -> None:
    parser = add_serving_command(
        sub,
        "up",
        serve,
        summary="run a gateway and workers locally on SQLite (no servers needed)",
        description="Run the gateway and workers on SQLite in the data directory "
        "(AGENT_DISPATCH_DATA_DIR, default: the XDG data directory), print the URL, a token "
        "and a sample request, run a demo turn, and serve until Ctrl-C. Exit 130 after Ctrl-C, 0 "
        "after SIGTERM, 1 when the demo turn did not succeed, 2 for bad settings, 3 when the port "
        "is taken.",
        listen=True,
        concurrency=True,
        refuse=_not_sqlite,
        # Quiet by default: this is an interactive command; AGENT_DISPATCH_LOG_LEVEL turns logs up.
        quiet=True,
    )
    parser.add_argument("--no-demo", action="store_true", help="do not submit the demo turn")


def _say(text: str = "") -> None:
    print(text, flush=True)


def serve(args: argparse.Namespace, settings: Settings) -> int:
    from agent_dispatch.gateway import (
        Components,
        GatewayServer,
        Principal,
        StopSignals,
        TokenRegistry,
        TokensFileError,
        hash_token,
        load_tokens_file,
        new_token,
        write_tokens_file,
    )
    from agent_dispatch.runtime import (
        EXIT_FAILURE,
        EXIT_INTERRUPTED,
        EXIT_OK,
        EXIT_UNAVAILABLE,
        EXIT_USAGE,
        StartupError,
        open_runtime,
    )
    from agent_dispatch.worker import build_worker

    host = args.host or settings.gateway_host
    port = settings.gateway_port if args.port is None else args.port
    # The port first, before anything is written: a second `up` on a taken port must leave the
    # running one's tokens file (and so its printed token) alone.
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:
        _fail(f"cannot listen on port {port}: {exc.strerror}; try --port 0 for any free port")
        return EXIT_UNAVAILABLE

    data_dir = settings.data_dir
    tokens_path = settings.tokens_file or data_dir / "tokens.yaml"
    settings = settings.model_copy(update={"tokens_file": tokens_path})
    # Fresh tokens for `local` and the web UI's `admin` each run (their plaintext is shown once);
    # other tenants and administrators are kept.
    token = new_token()
    admin_token = new_token()
    try:
        existing = load_tokens_file(tokens_path) if tokens_path.exists() else {}
    except TokensFileError as exc:
        sock.close()
        _fail(f"invalid setting AGENT_DISPATCH_TOKENS_FILE: {exc}")
        return EXIT_USAGE
    mine = {Principal(LOCAL_TENANT), Principal(LOCAL_ADMIN, admin=True)}
    principals = {p: digests for p, digests in existing.items() if p not in mine}
    principals[Principal(LOCAL_TENANT)] = (bytes.fromhex(hash_token(token)),)
    principals[Principal(LOCAL_ADMIN, admin=True)] = (bytes.fromhex(hash_token(admin_token)),)

    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        # One store/transport pair for the gateway and the workers (one SQLite file, one writer).
        runtime = open_runtime(settings, migrate=True)
    except StartupError as exc:
        sock.close()
        _fail(str(exc))
        return exc.exit_code
    try:
        worker = build_worker(settings, concurrency=args.concurrency, runtime=runtime)
    except StartupError as exc:
        sock.close()
        runtime.close()
        _fail(str(exc))
        return exc.exit_code
    tokens = TokenRegistry(principals, path=tokens_path)
    components = Components(runtime, tokens)
    server = GatewayServer(components, host=host, port=port, sock=sock)
    try:
        server.start()
    except BaseException:
        sock.close()
        runtime.close()
        raise
    write_tokens_file(
        tokens_path,
        {p.name: [d.hex() for d in digests] for p, digests in principals.items() if not p.admin},
        admins={p.name: [d.hex() for d in digests] for p, digests in principals.items() if p.admin},
    )
    worker.start()

    code = EXIT_OK
    try:
        _banner(server.url, token, data_dir, worker.concurrency)
        _say(f"  web UI:  {server.url}/ui/")
        _say(
            f"           sign in with the token above (tenant 'local'), or as '{LOCAL_ADMIN}' (every tenant):"
        )
        _say(f"  admin:   {admin_token}")
        if not args.no_demo and not _demo(server.url, token):
            code = EXIT_FAILURE
        with StopSignals() as signals:
            _say("Serving. Press Ctrl-C to stop.")
            if signals.wait() == signal.SIGINT:
                code = EXIT_INTERRUPTED
    except KeyboardInterrupt:  # Ctrl-C during the demo, before the signal handler is in place
        code = EXIT_INTERRUPTED
    finally:
        _say("Stopping: no new requests or claims; finishing running turns...")
        server.stop()
        worker.stop()
        runtime.close()
        _say("Stopped.")
    return code


def _not_sqlite(settings: Settings) -> str | None:
    if settings.backend is Backend.SQLITE:
        return None
    return (
        f"runs on SQLite only; unset TASK_QUEUE_BACKEND={settings.backend.value} "
        "and STATE_DB_URI, or run `agent-dispatch gateway` and `agent-dispatch worker`"
    )


def _fail(message: str) -> None:
    print(f"agent-dispatch up: {message}", file=sys.stderr)


def _banner(url: str, token: str, data_dir: Any, concurrency: int) -> None:
    body = json.dumps({"kind": "hello", "payload": {"greeting": "hi"}})
    curl = " ".join(
        [
            "curl -sS -X POST",
            shlex.quote(f"{url}/api/turns"),
            "-H",
            shlex.quote(f"Authorization: Bearer {token}"),
            "-H 'Content-Type: application/json'",
            "-d",
            shlex.quote(body),
        ]
    )
    _say(f"agent-dispatch is up: gateway + {concurrency} worker threads on SQLite")
    _say(f"  data:    {data_dir}")
    _say(f"  gateway: {url}")
    _say(f"  token:   {token}")
    _say("           (tenant 'local'; shown once, stored only as its sha256)")
    _say("  try:")
    _say(f"    {curl}")
    _say(
        f"    curl -sS -H {shlex.quote(f'Authorization: Bearer {token}')} {shlex.quote(url + '/api/graph/jobs')}"
    )


def _demo(url: str, token: str) -> bool:
    """Submit one turn through the gateway, like any client would, and follow it to the end."""
    from agent_dispatch.cli._client import ClientError, HttpClient

    client = HttpClient(url, token)
    try:
        handle = client.submit({"kind": "demo", "payload": {"demo": True}})
        job_id = handle["job_id"]
        _say(f"demo turn {job_id}: {handle['state']}")
        last = handle["state"]
        started = time.monotonic()
        while time.monotonic() - started < DEMO_TIMEOUT_S:
            view = client.status(job_id)
            if view["state"] != last:
                last = view["state"]
                _say(f"demo turn {job_id}: {last}")
            if view.get("terminal") or last in {"succeeded", "failed", "cancelled", "dead_letter"}:
                break
            time.sleep(0.05)
        elapsed = time.monotonic() - started
    except ClientError as exc:
        _say(f"demo turn could not be submitted: {exc}")
        return False
    if last == "succeeded":
        _say(f"demo turn completed in {elapsed:.2f}s")
        return True
    _say(f"demo turn ended {last} after {elapsed:.1f}s")
    return False
