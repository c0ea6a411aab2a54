"""Per-tenant counts for the web UI's tenants page, read a page at a time (``TenantPages``).

Every store has it. PostgreSQL answers from per-tenant counters kept by the database
(``sql/tenants_v1.sql``) and one index probe per tenant for the oldest waiting item, so a page
costs the same with a thousand items or a million; the engine stores (memory, SQLite: local,
small) count their rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class TenantStats:
    """One tenant's items by where they stand, and when it was last served."""

    tenant: str
    #: submitted (waiting on dependencies) and ready items.
    queued: int
    #: leased and running items.
    running: int
    #: items in a terminal state (succeeded, failed, cancelled, dead_letter).
    done: int
    #: When the oldest still-queued item was created (``None`` when nothing is queued).
    oldest_waiting: datetime | None
    #: When an item of the tenant was last claimed (``None``: never, as far as the store knows).
    last_served: datetime | None


@runtime_checkable
class TenantPages(Protocol):
    def tenant_stats(
        self, *, after: str = "", limit: int = 50, tenants: Sequence[str] | None = None
    ) -> list[TenantStats]:
        """Tenants in name order after ``after``, at most ``limit``; with ``tenants``, only those
        of them the store has items of (an administrator's page, or one tenant's own row)."""

    def fold_tenant_counts(self) -> int:
        """Compact the counters (PostgreSQL folds their deltas); returns tenants folded."""
