"""Transport implementations of :class:`agent_dispatch.transport.Transport` (one module per backend).

Backends are imported lazily by whoever selects one, so a process that runs on SQLite never
loads the Kafka or PostgreSQL client libraries.
"""
