"""What every librdkafka client of ours shares: quiet logging, error reporting, error text."""

from __future__ import annotations

import logging
import time
from typing import Any

from confluent_kafka import KafkaError

log = logging.getLogger(__name__)
#: librdkafka's own log lines (they name broker addresses and repeat every reconnect attempt):
#: kept at DEBUG so a broker outage shows up through our typed errors, not a flood of lines.
_client_log = logging.getLogger("agent_dispatch.transports.kafka.client")


class ClientLog:
    """librdkafka logger: everything at DEBUG (see ``_client_log``)."""

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        if _client_log.isEnabledFor(logging.DEBUG):
            _client_log.debug(msg, *args)


class ErrorReporter:
    """``error_cb``: one WARNING per error kind per minute, by name only (no addresses)."""

    def __init__(self, role: str) -> None:
        self._role = role
        self._last: dict[str, float] = {}

    def __call__(self, err: KafkaError) -> None:
        now = time.monotonic()
        name = err.name()
        if now - self._last.get(name, -1e9) >= 60.0:
            self._last[name] = now
            log.warning(
                "kafka %s client error", self._role, extra={"kafka_error": name, "fatal": err.fatal()}
            )


def client_config(bootstrap_servers: str, client_id: str, role: str) -> dict[str, Any]:
    """The settings every client starts from; each role adds its own."""
    return {
        "bootstrap.servers": bootstrap_servers,
        "client.id": client_id,
        "socket.nagle.disable": True,
        "logger": ClientLog(),
        "error_cb": ErrorReporter(role),
    }


def error_of(exc: BaseException) -> KafkaError | None:
    arg = exc.args[0] if exc.args else None
    return arg if isinstance(arg, KafkaError) else None


def describe(exc: BaseException) -> str:
    """An error text without broker addresses: the client error's name and reason."""
    err = error_of(exc)
    if err is not None:
        return f"{err.name()}: {err.str()}"
    return type(exc).__name__ if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
