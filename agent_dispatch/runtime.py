"""The one assembly point: settings -> signing key, WorkItem store, transport and admission strategy.

Every entry point (gateway, worker, ``up``, the direct CLI client, the doctor's probes) opens its
parts here and nowhere else, so they all fail the same way: one :class:`StartupError` carrying one
exit code, by one rule (:func:`exit_code_for`, the README's table):

- 0 ok; 1 the command found a failure (a schema that needs ``agent-dispatch migrate`` is one);
- 2 bad usage or an invalid setting (a missing signing key, a plugin that cannot be loaded);
- 3 a required service is unreachable (a store or transport, selected explicitly or not);
- 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Final

from agent_dispatch import keys, stores, transports
from agent_dispatch.dispatch import Admission, choose_admission
from agent_dispatch.errors import BackendUnavailable, SchemaOutdated
from agent_dispatch.settings import Backend, InvalidSetting, Settings
from agent_dispatch.store import WorkItemStore
from agent_dispatch.transport import Transport

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNAVAILABLE: Final = 3
EXIT_INTERRUPTED: Final = 130


class StartupError(RuntimeError):
    """A configuration or reachability problem found before any work starts; carries the exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def exit_code_for(exc: BaseException) -> int:
    """The one rule that turns a start-up failure into the process's exit code."""
    if isinstance(exc, StartupError):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, BackendUnavailable):
        return EXIT_UNAVAILABLE
    if isinstance(exc, keys.SigningKeyMissing | InvalidSetting):
        return EXIT_USAGE
    return EXIT_FAILURE  # SchemaOutdated included: a finding, fixed by `agent-dispatch migrate`


def startup_error(exc: BaseException) -> StartupError:
    return exc if isinstance(exc, StartupError) else StartupError(str(exc), exit_code_for(exc))


class Runtime:
    """One signing key, one store, one transport (opened on first use, or at once) and the admission
    strategy for that pair, chosen once. The opener closes it (``close`` or a ``with`` block)."""

    def __init__(
        self,
        settings: Settings,
        signing_key: bytes,
        store: WorkItemStore,
        transport: Transport | None = None,
    ) -> None:
        self.settings = settings
        self.signing_key = signing_key
        self.store = store
        self._transport = transport
        self._admission: Admission | None = None
        self._lock = threading.Lock()

    @property
    def transport(self) -> Transport:
        """The transport, opened now if it was not yet (``StartupError`` when it cannot be)."""
        with self._lock:
            if self._transport is None:
                self._transport = _open_transport(self.settings)
            return self._transport

    @property
    def admission(self) -> Admission:
        """How this store/transport pair admits turns (chosen on first use, then kept)."""
        transport = self.transport
        with self._lock:
            if self._admission is None:
                self._admission = choose_admission(
                    self.store, transport, signing_key=self.signing_key, settings=self.settings
                )
            return self._admission

    def close(self) -> None:
        """Close the transport, then the store (idempotent; a failing close never masks another)."""
        with self._lock:
            transport, self._transport = self._transport, None
            self._admission = None
        if transport is not None:
            with contextlib.suppress(Exception):
                transport.close()
        with contextlib.suppress(Exception):
            self.store.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def signing_key(settings: Settings) -> bytes:
    try:
        return keys.signing_key(settings)
    except keys.SigningKeyMissing as exc:
        raise startup_error(exc) from None


def open_store(settings: Settings, *, migrate: bool = False) -> WorkItemStore:
    """The configured store (migrated first with ``migrate``), or ``StartupError``."""
    try:
        store = stores.open_store(settings)
    except (BackendUnavailable, SchemaOutdated) as exc:
        raise startup_error(exc) from None
    if migrate:
        try:
            store.migrate()
        except BaseException as exc:
            store.close()
            if isinstance(exc, BackendUnavailable | SchemaOutdated):
                raise startup_error(exc) from None
            raise
    return store


def _open_transport(settings: Settings) -> Transport:
    try:
        return transports.open_transport(settings)
    except BackendUnavailable as exc:
        raise startup_error(exc) from None


def open_transport(settings: Settings) -> Transport:
    """The configured transport, reachable and ready, or ``StartupError`` (3)."""
    return _open_transport(settings)


def open_runtime(settings: Settings, *, migrate: bool = False, transport: bool = True) -> Runtime:
    """Key, store and (unless ``transport=False``: opened on first use) transport, or ``StartupError``.

    ``migrate``: bring the store's schema up to date first (the local ``up`` does). SQLite is
    always migrated: its database is private to the process's data directory (a worker pod's
    emptyDir, say), so no separate ``agent-dispatch migrate`` step can reach it first.
    """
    key = signing_key(settings)
    store = open_store(settings, migrate=migrate or settings.backend is Backend.SQLITE)
    runtime = Runtime(settings, key, store)
    if transport:
        try:
            runtime.transport  # noqa: B018 - opens it now, so a failure is a start-up failure
        except BaseException:
            runtime.close()
            raise
    return runtime


__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "Runtime",
    "StartupError",
    "exit_code_for",
    "open_runtime",
    "open_store",
    "open_transport",
    "signing_key",
]
