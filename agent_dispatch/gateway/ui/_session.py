"""The web UI's session: a signed cookie naming who signed in, and the CSRF token of that session.

The cookie holds ``base64(json) . hmac`` where the JSON is the principal, the sha256 of the token
used to sign in (never the token), a random nonce and an expiry. The HMAC key is derived from the
gateway's signing key, so every replica accepts every replica's sessions. Each request re-checks the
digest against the tokens file: removing a token ends the sessions it opened. The CSRF token is an
HMAC of the session's nonce: a page carries it in a hidden field (or the ``X-CSRF-Token`` header)
and every state-changing request must present it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Final

from agent_dispatch.gateway._auth import TokenRegistry
from agent_dispatch.gateway.insight import Scope

COOKIE: Final = "agent_dispatch_ui"
LIFETIME_S: Final = 8 * 3600


@dataclass(frozen=True)
class Session:
    scope: Scope
    csrf: str


class Sessions:
    def __init__(self, signing_key: bytes, tokens: TokenRegistry) -> None:
        self._key = hmac.new(signing_key, b"agent-dispatch web UI session", hashlib.sha256).digest()
        self._tokens = tokens

    def _mac(self, data: bytes) -> str:
        return (
            base64.urlsafe_b64encode(hmac.new(self._key, data, hashlib.sha256).digest()).decode().rstrip("=")
        )

    def open(self, token: str) -> str | None:
        """The cookie value for a session of ``token``'s holder; ``None`` for a token nobody holds."""
        digest = hashlib.sha256(token.encode()).digest()
        if self._tokens.identify_digest(digest) is None:
            return None
        body = {"d": digest.hex(), "n": secrets.token_hex(16), "e": int(time.time()) + LIFETIME_S}
        data = base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode()).decode()
        return f"{data}.{self._mac(data.encode())}"

    def read(self, cookie: str | None) -> Session | None:
        """The session in a cookie, if its signature, expiry and token are all still good."""
        if not cookie or "." not in cookie or len(cookie) > 1000:
            return None
        data, _, mac = cookie.rpartition(".")
        if not hmac.compare_digest(mac, self._mac(data.encode())):
            return None
        try:
            body = json.loads(base64.urlsafe_b64decode(data.encode()))
            digest, nonce, expires = bytes.fromhex(body["d"]), str(body["n"]), int(body["e"])
        except (ValueError, KeyError, TypeError):
            return None
        if expires < time.time():
            return None
        principal = self._tokens.identify_digest(digest)
        if principal is None:
            return None
        return Session(Scope(principal.name, principal.admin), self._mac(b"csrf:" + nonce.encode()))

    @staticmethod
    def csrf_ok(session: Session, presented: str | None) -> bool:
        return bool(presented) and hmac.compare_digest(session.csrf, presented or "")
