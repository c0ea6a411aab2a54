"""The HTTP gateway: admission of agent turns, job status and cancellation, per-tenant auth.

Built on aiohttp, which the operator's kopf already brings (see ``docs/gateway.md``). It never
runs a turn inline: every accepted request becomes a WorkItem plus a signed envelope.
"""

from __future__ import annotations

from agent_dispatch.gateway._app import GATEWAY, ApiError, Gateway, create_app, job_handle
from agent_dispatch.gateway._auth import (
    Principal,
    TokenRegistry,
    TokensFileError,
    hash_token,
    load_tokens_file,
    new_token,
    write_tokens_file,
)
from agent_dispatch.gateway._models import TurnBody
from agent_dispatch.gateway._serve import Components, GatewayServer, StopSignals
from agent_dispatch.runtime import EXIT_USAGE, StartupError, open_runtime
from agent_dispatch.settings import Settings

__all__ = [
    "GATEWAY",
    "ApiError",
    "Components",
    "Gateway",
    "GatewayServer",
    "GatewayStartupError",
    "Principal",
    "StopSignals",
    "TokenRegistry",
    "TokensFileError",
    "TurnBody",
    "create_app",
    "hash_token",
    "job_handle",
    "load_tokens",
    "load_tokens_file",
    "new_token",
    "open_components",
    "write_tokens_file",
]


#: The one start-up error of every entry point (kept under the gateway's old name too).
GatewayStartupError = StartupError


def open_components(settings: Settings, *, migrate: bool = False) -> Components:
    """Signing key, tokens, store and transport named by the settings, ready to serve.

    Tokens are checked first (a bad file is a setting: 2), then the parts are opened by
    :func:`agent_dispatch.runtime.open_runtime`, whose one rule gives the other exit codes.
    """
    tokens = load_tokens(settings)
    runtime = open_runtime(settings, migrate=migrate)
    return Components(runtime, tokens)


def load_tokens(settings: Settings) -> TokenRegistry:
    """The tenants' token hashes from AGENT_DISPATCH_TOKENS_FILE, or ``StartupError`` (2)."""
    if settings.tokens_file is None:
        raise StartupError(
            "invalid setting AGENT_DISPATCH_TOKENS_FILE: is required to serve the gateway; "
            "allowed: a file (YAML or JSON) mapping each tenant to the sha256 hex of its bearer token",
            EXIT_USAGE,
        )
    try:
        tokens = TokenRegistry.from_file(settings.tokens_file)
    except TokensFileError as exc:
        raise StartupError(f"invalid setting AGENT_DISPATCH_TOKENS_FILE: {exc}", EXIT_USAGE) from None
    if not tokens.tenants:
        raise StartupError("invalid setting AGENT_DISPATCH_TOKENS_FILE: lists no tenants", EXIT_USAGE)
    return tokens
