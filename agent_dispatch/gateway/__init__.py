"""The HTTP gateway: admission of agent turns, job status and cancellation, per-tenant auth.

Built on aiohttp, which the operator's kopf already brings (see ``docs/gateway.md``). It never
runs a turn inline: every accepted request becomes a WorkItem plus a signed envelope.
"""

from __future__ import annotations

from agent_dispatch.errors import BackendUnavailable, SchemaOutdated
from agent_dispatch.gateway._app import GATEWAY, ApiError, Gateway, create_app, job_handle
from agent_dispatch.gateway._auth import (
    TokenRegistry,
    TokensFileError,
    hash_token,
    new_token,
    write_tokens_file,
)
from agent_dispatch.gateway._serve import Components, GatewayServer, wait_for_signal
from agent_dispatch.settings import Settings

__all__ = [
    "GATEWAY",
    "ApiError",
    "Components",
    "Gateway",
    "GatewayServer",
    "GatewayStartupError",
    "TokenRegistry",
    "TokensFileError",
    "create_app",
    "hash_token",
    "job_handle",
    "new_token",
    "open_components",
    "wait_for_signal",
    "write_tokens_file",
]


class GatewayStartupError(RuntimeError):
    """A configuration or reachability problem found before serving; carries the CLI exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def open_components(settings: Settings, *, migrate: bool = False) -> Components:
    """Signing key, tokens, store and transport named by the settings, ready to serve.

    Exit codes on failure follow the CLI: 2 for configuration (including an explicitly selected
    backend that cannot be reached), 3 for an unreachable service, 1 for a schema that needs
    ``agent-dispatch migrate``.
    """
    from agent_dispatch import keys, stores, transports

    try:
        key = keys.signing_key(settings)
    except keys.SigningKeyMissing as exc:
        raise GatewayStartupError(str(exc), 2) from None
    if settings.tokens_file is None:
        raise GatewayStartupError(
            "invalid setting AGENT_DISPATCH_TOKENS_FILE: is required to serve the gateway; "
            "allowed: a file (YAML or JSON) mapping each tenant to the sha256 hex of its bearer token",
            2,
        )
    try:
        tokens = TokenRegistry.from_file(settings.tokens_file)
    except TokensFileError as exc:
        raise GatewayStartupError(f"invalid setting AGENT_DISPATCH_TOKENS_FILE: {exc}", 2) from None
    if not tokens.tenants:
        raise GatewayStartupError("invalid setting AGENT_DISPATCH_TOKENS_FILE: lists no tenants", 2)
    # Every entry point fails the same way: an explicitly selected backend that cannot be
    # reached is a configuration error (2); otherwise an unreachable service is 3.
    unreachable = 2 if settings.backend_explicit else 3
    try:
        store = stores.open_store(settings)
    except BackendUnavailable as exc:
        raise GatewayStartupError(str(exc), unreachable) from None
    try:
        if migrate:
            store.migrate()
        transport = transports.open_transport(settings)
    except BackendUnavailable as exc:
        store.close()
        raise GatewayStartupError(str(exc), unreachable) from None
    except SchemaOutdated as exc:
        store.close()
        raise GatewayStartupError(str(exc), 1) from None
    return Components(store, transport, key, tokens)
