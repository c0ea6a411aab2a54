"""What the SQL stores and transports share, below both: one ``.sql`` loader, one migration
runner, one retry rule for PostgreSQL transactions, one per-thread SQLite connection set."""
