-- Version 9: a node's telemetry snapshot may be stored compact (ledger/compact.py): its metadata
-- and payload as bytes in `body`, `data` and `metadata` NULL, and the digest of the GPUs it
-- samples in `sampled` (mf_sampled) for retention. Events already stored keep their jsonb; a log
-- holding both forms reads, replays and rebuilds the same (docs/storage.md).
--
-- The append functions take the bodies, the receive times and the digests: their earlier
-- signatures go, so servers of the previous release stop appending once this step ran (upgrade
-- every server together: docs/upgrades.md). The GPU sample functions go: samples are decoded by
-- the server (api/services/reads/samples.py), which reads both forms.
ALTER TABLE events ADD COLUMN body bytea, ADD COLUMN sampled uuid;
ALTER TABLE events ALTER COLUMN data DROP NOT NULL, ALTER COLUMN metadata DROP NOT NULL;
ALTER TABLE events ADD CONSTRAINT events_body_check CHECK (
    CASE WHEN body IS NULL THEN data IS NOT NULL AND metadata IS NOT NULL
         ELSE data IS NULL AND metadata IS NULL AND event_class = 'observation' END);

DROP FUNCTION IF EXISTS mf_append_kept(text[], bigint[], integer[], uuid[], text[], text[], integer[],
                                       jsonb[], jsonb[], text, bigint[], bigint[], timestamptz);
DROP FUNCTION IF EXISTS mf_append_many(text[], bigint[], integer[], uuid[], text[], text[], integer[],
                                       jsonb[], jsonb[], boolean);
DROP FUNCTION IF EXISTS mf_samples(bigint[]);
DROP FUNCTION IF EXISTS mf_accelerator_sample(bigint, text);
