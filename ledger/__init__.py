"""The event log: catalog, PostgreSQL event store, node fold and the pure reconciler."""
