"""The envelope signing key: configured in production, generated once for local SQLite runs."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from agent_dispatch.settings import Backend, Settings


class SigningKeyMissing(ValueError):
    pass


def signing_key(settings: Settings) -> bytes:
    if settings.signing_key is not None:
        return settings.signing_key.get_secret_value().encode()
    if settings.backend is not Backend.SQLITE:
        raise SigningKeyMissing(
            f"invalid setting AGENT_DISPATCH_SIGNING_KEY: is required with TASK_QUEUE_BACKEND={settings.backend.value}; "
            "allowed: at least 32 characters"
        )
    return _local_key(settings.data_dir / "signing.key")


def _local_key(path: Path) -> bytes:
    # Local runs share one generated key between gateway and workers through the data directory.
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes().strip()
    with os.fdopen(fd, "wb") as out:
        key = secrets.token_urlsafe(48).encode()
        out.write(key)
    return key
