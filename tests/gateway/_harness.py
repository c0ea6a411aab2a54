"""A real gateway on a free loopback port, over a real store and transport, plus a tiny HTTP client."""

from __future__ import annotations

import contextlib
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent_dispatch import stores, transports
from agent_dispatch.gateway import Components, GatewayServer, TokenRegistry, hash_token, write_tokens_file
from agent_dispatch.runtime import Runtime
from agent_dispatch.settings import Settings
from agent_dispatch.store import WorkItemStore
from agent_dispatch.transport import Transport

TOKENS = {"tenant-a": "token-of-tenant-a-0123456789", "tenant-b": "token-of-tenant-b-0123456789"}
SIGNING_KEY = "s" * 48
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Running:
    url: str
    settings: Settings
    store: WorkItemStore
    transport: Transport
    server: GatewayServer
    closers: list[Any] = field(default_factory=list)

    def execute_in_database(self, statement: str) -> None:
        """Run one SQL statement in the gateway's database (PostgreSQL or the SQLite file) from
        outside the gateway, as an operator or a fault would."""
        uri = self.settings.state_db_uri
        if uri is not None:
            import psycopg

            with psycopg.connect(uri.get_secret_value(), autocommit=True) as conn:
                conn.execute(statement)
            return
        import sqlite3

        conn = sqlite3.connect(self.settings.sqlite_path)
        try:
            conn.execute(statement)
            conn.commit()
        finally:
            conn.close()

    def call(
        self,
        method: str,
        path: str,
        *,
        tenant: str | None = "tenant-a",
        token: str | None = None,
        body: Any = None,
        raw: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """One request; ``tenant`` picks that tenant's token, ``token`` overrides it (``tenant=None``: none)."""
        sent = dict(headers or {})
        bearer = token if token is not None else (TOKENS[tenant] if tenant else None)
        if bearer is not None:
            sent["Authorization"] = f"Bearer {bearer}"
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        if data is not None:
            sent.setdefault("Content-Type", "application/json")
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=sent)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return Reply(response.status, dict(response.headers), response.read())
        except urllib.error.HTTPError as exc:
            return Reply(exc.code, dict(exc.headers), exc.read())

    def chunked(self, path: str, chunks: list[bytes], *, tenant: str = "tenant-a") -> Reply:
        """A body sent without Content-Length (chunked transfer encoding)."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request(
                "POST",
                path,
                body=iter(chunks),
                headers={"Authorization": f"Bearer {TOKENS[tenant]}", "Content-Type": "application/json"},
                encode_chunked=True,
            )
            response = conn.getresponse()
            return Reply(response.status, dict(response.getheaders()), response.read())
        except (ConnectionResetError, BrokenPipeError):
            # The server may answer 413 and close before the client finishes sending.
            response = conn.getresponse()
            return Reply(response.status, dict(response.getheaders()), response.read())
        finally:
            conn.close()

    def submit(self, body: Any = None, *, tenant: str = "tenant-a", key: str | None = None) -> Reply:
        headers = {"Idempotency-Key": key} if key else None
        return self.call(
            "POST", "/api/turns", tenant=tenant, body=body or {"kind": "t", "payload": {}}, headers=headers
        )


def gateway_settings(backend: str, data_dir: Path, dsn: str | None, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "backend_choice": backend,
        "data_dir": data_dir,
        "signing_key": SIGNING_KEY,
        "tokens_file": data_dir / "tokens.yaml",
        "claim_ttl_s": 6,
        "renew_interval_s": 1,
        "sweep_interval_s": 1,
        "metrics_port": 0,
    }
    if backend == "postgres":
        values["state_db_uri"] = dsn
    values.update(overrides)
    return Settings(**values)


@contextlib.contextmanager
def running_gateway(settings: Settings) -> Iterator[Running]:
    """Migrate, write the tokens file (hashed), open store + transport, serve on port 0."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    assert settings.tokens_file is not None
    write_tokens_file(settings.tokens_file, {t: [hash_token(tok)] for t, tok in TOKENS.items()})
    store = stores.open_store(settings)
    store.migrate()
    transport = transports.open_transport(settings)
    runtime = Runtime(settings, SIGNING_KEY.encode(), store, transport)
    components = Components(runtime, TokenRegistry.from_file(settings.tokens_file))
    server = GatewayServer(components, host="127.0.0.1", port=0).start()
    running = Running(server.url, settings, store, transport, server)
    try:
        yield running
    finally:
        server.stop()
        for close in reversed(running.closers):
            with contextlib.suppress(Exception):
                close()
        components.close()
