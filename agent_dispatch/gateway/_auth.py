"""Bearer tokens mapped to tenants, kept only as SHA-256 hashes.

The tokens file (``AGENT_DISPATCH_TOKENS_FILE``) is YAML or JSON: each tenant maps to the sha256
hex of its token, or to ``{token_sha256: <hex> | [<hex>, ...]}`` (several hashes let a token be
rotated without downtime). A mounted Kubernetes Secret is such a file; when the kubelet swaps
the Secret's contents the file changes and the registry picks the new hashes up on its own.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import yaml

log = logging.getLogger("agent_dispatch.gateway")

#: Tenants end up in envelopes and scheduling columns, so they obey the envelope's reference shape.
TENANT_PATTERN: Final = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}$")
_HEX64: Final = re.compile(r"^[0-9a-f]{64}$")
#: How often the file's identity is checked for a change (a stat, not a read).
RELOAD_CHECK_S: Final = 2.0


class TokensFileError(ValueError):
    """The tokens file is missing, unreadable or malformed; the message says which."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh token with 256 bits of randomness."""
    return secrets.token_urlsafe(32)


def parse_tokens(document: Any) -> dict[str, tuple[bytes, ...]]:
    """Tenant -> token hashes (raw digests), from a parsed YAML/JSON document."""
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        raise TokensFileError("tokens file must map each tenant to a sha256 hex or {token_sha256: ...}")
    tenants: dict[str, tuple[bytes, ...]] = {}
    for tenant, entry in document.items():
        if not isinstance(tenant, str) or not TENANT_PATTERN.match(tenant):
            raise TokensFileError(f"tenant {str(tenant)[:40]!r} is not 1-200 of letters, digits and ._:@/+=-")
        value = entry
        if isinstance(entry, Mapping):
            if set(entry) != {"token_sha256"}:
                raise TokensFileError(f"tenant {tenant!r}: expected exactly the key token_sha256")
            value = entry["token_sha256"]
        hashes = [value] if isinstance(value, str) else value
        if not isinstance(hashes, list) or not hashes:
            raise TokensFileError(f"tenant {tenant!r}: expected a sha256 hex or a list of them")
        digests = []
        for item in hashes:
            text = item.strip().lower() if isinstance(item, str) else ""
            if not _HEX64.match(text):
                # Never echo the value: someone may have pasted a plaintext token by mistake.
                raise TokensFileError(f"tenant {tenant!r}: a token hash is not 64 hex characters (sha256)")
            digests.append(bytes.fromhex(text))
        tenants[tenant] = tuple(digests)
    return tenants


def load_tokens_file(path: Path) -> dict[str, tuple[bytes, ...]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TokensFileError(f"tokens file cannot be read: {exc.strerror or type(exc).__name__}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError:
        raise TokensFileError("tokens file is not valid YAML or JSON") from None
    return parse_tokens(document)


def write_tokens_file(path: Path, tenants: Mapping[str, Sequence[str]]) -> None:
    """Write tenant -> sha256 hex digests atomically, readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write("# tenant: sha256 hex of its bearer token (the plaintext is never stored)\n")
        document = {t: {"token_sha256": h[0] if len(h) == 1 else list(h)} for t, h in tenants.items()}
        yaml.safe_dump(document, out, sort_keys=True)
    tmp.replace(path)


class TokenRegistry:
    """Resolves a presented bearer token to its tenant, in time independent of which one matches."""

    def __init__(self, tenants: Mapping[str, tuple[bytes, ...]], *, path: Path | None = None) -> None:
        self._entries = self._flatten(tenants)
        self._path = path
        self._identity = self._stat() if path is not None else None
        self._next_check = time.monotonic() + RELOAD_CHECK_S
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: Path) -> TokenRegistry:
        return cls(load_tokens_file(path), path=path)

    @classmethod
    def from_plaintext(cls, tokens: Mapping[str, str]) -> TokenRegistry:
        """For tests and embedding: tenant -> plaintext token (hashed immediately)."""
        return cls({t: (hashlib.sha256(tok.encode()).digest(),) for t, tok in tokens.items()})

    @staticmethod
    def _flatten(tenants: Mapping[str, tuple[bytes, ...]]) -> list[tuple[str, bytes]]:
        return [(tenant, digest) for tenant, digests in tenants.items() for digest in digests]

    @property
    def tenants(self) -> set[str]:
        return {tenant for tenant, _ in self._entries}

    def authenticate(self, token: str) -> str | None:
        self._maybe_reload()
        presented = hashlib.sha256(token.encode()).digest()
        found: str | None = None
        # Compare against every entry, without stopping early, so timing does not reveal which
        # entry (or whether any) matched; hashing first makes the comparison length-independent.
        for tenant, digest in self._entries:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

    def _stat(self) -> tuple[int, int, int] | None:
        assert self._path is not None
        try:
            st = self._path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _maybe_reload(self) -> None:
        if self._path is None or time.monotonic() < self._next_check:
            return
        with self._lock:
            self._next_check = time.monotonic() + RELOAD_CHECK_S
            identity = self._stat()
            if identity is None or identity == self._identity:
                return
            try:
                entries = self._flatten(load_tokens_file(self._path))
            except TokensFileError as exc:
                # Keep serving with the last good tokens rather than locking every tenant out.
                log.warning("tokens file changed but is invalid; keeping the previous tokens: %s", exc)
                return
            self._entries = entries
            self._identity = identity
            log.info("tokens file reloaded", extra={"tenants": len({t for t, _ in entries})})
