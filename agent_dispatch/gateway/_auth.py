"""Bearer tokens mapped to tenants, kept only as SHA-256 hashes.

The tokens file (``AGENT_DISPATCH_TOKENS_FILE``) is YAML or JSON: each tenant maps to the sha256
hex of its token, or to ``{token_sha256: <hex> | [<hex>, ...]}`` (several hashes let a token be
rotated without downtime). A mounted Kubernetes Secret is such a file; when the kubelet swaps
the Secret's contents the file changes and the registry picks the new hashes up on its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

log = logging.getLogger("agent_dispatch.gateway")

#: Tenants end up in envelopes and scheduling columns, so they obey the envelope's reference shape.
TENANT_PATTERN: Final = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}$")
_HEX64: Final = re.compile(r"^[0-9a-f]{64}$")
#: How often the file's identity is checked for a change (a stat, not a read).
RELOAD_CHECK_S: Final = 2.0


#: The ``role`` of an administrator's entry (a tenant's entry has no role, or ``role: tenant``).
ADMIN: Final = "admin"
ROLES: Final = ("tenant", ADMIN)


@dataclass(frozen=True)
class Principal:
    """Who a token belongs to: a tenant, or an administrator (``admin``) who sees every tenant."""

    name: str
    admin: bool = False


class TokensFileError(ValueError):
    """The tokens file is missing, unreadable or malformed; the message says which."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh token with 256 bits of randomness."""
    return secrets.token_urlsafe(32)


def parse_tokens(document: Any) -> dict[str, tuple[bytes, ...]]:
    """Tenant -> token hashes (raw digests), from a parsed YAML/JSON document (admins left out)."""
    return {p.name: digests for p, digests in parse_principals(document).items() if not p.admin}


def parse_principals(document: Any) -> dict[Principal, tuple[bytes, ...]]:
    """Tenants and administrators -> token hashes (raw digests), from a parsed YAML/JSON document."""
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        raise TokensFileError("tokens file must map each tenant to a sha256 hex or {token_sha256: ...}")
    tenants: dict[Principal, tuple[bytes, ...]] = {}
    for tenant, entry in document.items():
        if not isinstance(tenant, str) or not TENANT_PATTERN.match(tenant):
            raise TokensFileError(f"tenant {str(tenant)[:40]!r} is not 1-200 of letters, digits and ._:@/+=-")
        value = entry
        role = "tenant"
        if isinstance(entry, Mapping):
            if "token_sha256" not in entry or not set(entry) <= {"token_sha256", "role"}:
                raise TokensFileError(
                    f"tenant {tenant!r}: expected exactly the key token_sha256 (and optionally role: admin)"
                )
            value = entry["token_sha256"]
            role = entry.get("role", "tenant")
            if role not in ROLES:
                raise TokensFileError(f"tenant {tenant!r}: role must be one of {', '.join(ROLES)}")
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
        tenants[Principal(tenant, admin=role == ADMIN)] = tuple(digests)
    return tenants


def load_tokens_file(path: Path) -> dict[Principal, tuple[bytes, ...]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TokensFileError(f"tokens file cannot be read: {exc.strerror or type(exc).__name__}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError:
        raise TokensFileError("tokens file is not valid YAML or JSON") from None
    return parse_principals(document)


def write_tokens_file(
    path: Path, tenants: Mapping[str, Sequence[str]], *, admins: Mapping[str, Sequence[str]] | None = None
) -> None:
    """Write tenant (and admin) -> sha256 hex digests atomically, readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write("# tenant: sha256 hex of its bearer token (the plaintext is never stored)\n")
        document: dict[str, dict[str, Any]] = {
            t: {"token_sha256": h[0] if len(h) == 1 else list(h)} for t, h in tenants.items()
        }
        for name, hashes in (admins or {}).items():
            document[name] = {"token_sha256": hashes[0] if len(hashes) == 1 else list(hashes), "role": ADMIN}
        yaml.safe_dump(document, out, sort_keys=True)
    tmp.replace(path)


class TokenRegistry:
    """Resolves a presented bearer token to its tenant by the token's SHA-256 digest."""

    def __init__(
        self,
        tenants: Mapping[str, tuple[bytes, ...]] | Mapping[Principal, tuple[bytes, ...]],
        *,
        path: Path | None = None,
    ) -> None:
        self._entries = self._flatten(tenants)
        self._by_digest = self._index(self._entries)
        self._path = path
        self._identity = self._stat() if path is not None else None
        self._next_check = time.monotonic() + RELOAD_CHECK_S
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: Path) -> TokenRegistry:
        return cls(load_tokens_file(path), path=path)

    @classmethod
    def from_plaintext(
        cls, tokens: Mapping[str, str], *, admins: Mapping[str, str] | None = None
    ) -> TokenRegistry:
        """For tests and embedding: tenant (and admin) -> plaintext token (hashed immediately)."""
        entries = {Principal(t): (hashlib.sha256(tok.encode()).digest(),) for t, tok in tokens.items()}
        for name, tok in (admins or {}).items():
            entries[Principal(name, admin=True)] = (hashlib.sha256(tok.encode()).digest(),)
        return cls(entries)

    @staticmethod
    def _flatten(
        tenants: Mapping[str, tuple[bytes, ...]] | Mapping[Principal, tuple[bytes, ...]],
    ) -> list[tuple[Principal, bytes]]:
        return [
            (who if isinstance(who, Principal) else Principal(who), digest)
            for who, digests in tenants.items()
            for digest in digests
        ]

    @staticmethod
    def _index(entries: list[tuple[Principal, bytes]]) -> dict[bytes, Principal]:
        # A digest listed for two principals resolves to the later one (as the file reads).
        return dict((digest, principal) for principal, digest in entries)

    @property
    def tenants(self) -> set[str]:
        return {p.name for p, _ in self._entries if not p.admin}

    def authenticate(self, token: str) -> str | None:
        """The tenant a token belongs to; ``None`` for an unknown token or an administrator's."""
        principal = self.identify(token)
        return None if principal is None or principal.admin else principal.name

    def identify(self, token: str) -> Principal | None:
        """Whoever holds ``token``: a tenant or an administrator."""
        return self.identify_digest(hashlib.sha256(token.encode()).digest())

    def identify_digest(self, presented: bytes) -> Principal | None:
        """Whoever holds the token with this sha256 digest (a UI session keeps the digest, not the token,
        so a token removed from the file ends its sessions too)."""
        self._maybe_reload()
        # One hash-table lookup by the token's SHA-256 digest, whatever the number of tenants (a
        # constant-time comparison with every entry cost 3% of a status read's CPU at 100 tenants,
        # and grew with them). Its timing depends only on the digest, which no one can steer
        # toward a stored one without a preimage of SHA-256, so it tells nothing about any token.
        return self._by_digest.get(presented)

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
            self._by_digest = self._index(entries)
            self._identity = identity
            log.info("tokens file reloaded", extra={"tenants": len({p for p, _ in entries})})
