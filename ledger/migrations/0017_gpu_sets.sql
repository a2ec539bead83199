-- Version 17: the GPU sets compact snapshots of format 3 name by their `sampled` digest, so that
-- a snapshot lists each GPU as an index instead of its 16-byte UUID (docs/storage.md). A new,
-- empty table: the bodies already stored keep their formats, and a server of this release writes
-- a set before the first snapshot that names it. Its triggers are installed with the other code.
CREATE TABLE gpu_sets (
    sampled     uuid PRIMARY KEY,
    gpus        text NOT NULL,
    tx_id       xid8 NOT NULL DEFAULT pg_current_xact_id(),
    CONSTRAINT gpu_sets_digest_check CHECK (md5(gpus)::uuid = sampled)
);
COMMENT ON COLUMN events.body IS
    'A compact observation (ledger/compact.py): msgpack [format, metadata, payload], format 1, 2 or 3.';
