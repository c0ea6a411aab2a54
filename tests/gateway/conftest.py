"""The idempotency-contract fixtures (``contract_backend``, ``contract_settings``) for this package."""

from tests.gateway._contract import contract_backend, contract_settings

__all__ = ["contract_backend", "contract_settings"]
