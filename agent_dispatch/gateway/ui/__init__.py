"""The web UI under ``/ui/``: pages over the gateway's service layer, served by the gateway itself.

Server-rendered HTML (``_html``) from view models (``_views``) that the page's script refreshes
from ``/ui/api/...`` every few seconds; sign-in by token into a signed session cookie
(``_session``); every asset ships in the package (``static/``), nothing is fetched from elsewhere.
"""

from __future__ import annotations

from agent_dispatch.gateway.ui._routes import install

__all__ = ["install"]
