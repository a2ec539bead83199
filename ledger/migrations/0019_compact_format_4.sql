-- Version 19: compact bodies of format 4 (docs/storage.md): format 3, but a GPU's telemetry value
-- or health that is the snapshot's first GPU's is stored as a reference to it. Nothing in the
-- tables changes; the step records that the log may hold bodies a server of an earlier release
-- cannot read, so such a server refuses the database (docs/upgrades.md).
COMMENT ON COLUMN events.body IS
    'A compact observation (ledger/compact.py): msgpack [format, metadata, payload], format 1, 2, 3 or 4.';
