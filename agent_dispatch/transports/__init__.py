"""Transport implementations, selected by ``TASK_QUEUE_BACKEND`` (see :class:`Settings.backend`).

There is never a silent fallback: the selected transport is reachable, or ``open_transport``
raises :class:`BackendUnavailable` naming it (entry points turn that into their exit code).
"""

from __future__ import annotations

from agent_dispatch.errors import BackendUnavailable
from agent_dispatch.settings import Backend, Settings
from agent_dispatch.transport import Transport


def open_transport(settings: Settings) -> Transport:
    """The transport ``settings.backend`` names, connected and with its schema/topic in place."""
    backend = settings.backend
    transport: Transport
    if backend is Backend.POSTGRES:
        from agent_dispatch.transports.postgres import PostgresTransport

        transport = PostgresTransport.from_settings(settings)
    elif backend is Backend.SQLITE:
        from agent_dispatch.transports.sqlite import SqliteTransport

        transport = SqliteTransport.from_settings(settings)
    elif backend is Backend.KAFKA:
        # Imported lazily: confluent-kafka loads librdkafka, which SQLite/PostgreSQL users never need.
        from agent_dispatch.transports.kafka import KafkaTransport

        transport = KafkaTransport(settings)
    else:  # pragma: no cover - Backend is closed
        raise BackendUnavailable(f"unknown transport backend {backend!r}")
    try:
        transport.ensure_ready()
    except BackendUnavailable as exc:
        transport.close()
        message = str(exc)
        if backend.value not in message:
            message = f"{backend.value} transport unavailable: {message}"
        raise BackendUnavailable(message) from None
    except BaseException:
        transport.close()
        raise
    return transport


__all__ = ["open_transport"]
