-- Version 15: compact observation bodies of format 2 (ledger/compact.py). Nothing in the tables
-- changes; the step exists so that a server of an earlier release, which cannot decode a format 2
-- body, refuses to start on a database this release has written to ("newer than this release
-- knows") instead of failing the reads of every snapshot it meets.
COMMENT ON COLUMN events.body IS
    'A compact observation (ledger/compact.py): msgpack [format, metadata, payload], format 1 or 2.';
