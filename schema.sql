-- ModelForge hardware plane: the database schema of this release, schema version 23, whole.
--
-- `modelforge-hw migrate` (and `serve`, at start) creates a new database from this file, in one
-- transaction. A database made by an older release is brought to the same schema by the numbered
-- steps in ledger/migrations/ instead (docs/upgrades.md); tests/test_upgrade.py checks that both
-- ways end in the same catalog.
--
-- The functions and triggers are one per file under ledger/sql/, included below with psql's `\ir`
-- (paths relative to ledger/, so `psql -f ledger/schema.sql` runs this file as it is). They are
-- code rather than data: every migrate installs them again, in the order of the lines below, so a
-- release's new function bodies reach an existing database without a numbered step.

-- Whether lz4 is there, asked by the storage settings below.
\ir sql/functions/mf_has_lz4.sql
-- A stream's key in the log's indexes by stream, which are made below.
\ir sql/functions/mf_stream_key.sql

-- Every schema version this database has: one made from this file has them all.
CREATE TABLE schema_version (
    version     integer PRIMARY KEY,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- ---------------------------------------------------------------------------------------------
-- The event log
-- ---------------------------------------------------------------------------------------------

-- One row per stream (one stream per compute node). `version` is the number of the stream's last
-- event; `lifecycle_version` counts its lifecycle events only (the node's "generation": telemetry
-- does not move it). `head_hash` is the hash of the newest lifecycle event, kept beside the stream
-- so that an edit to the newest event is caught too (ledger/verify.py). What every append changes
-- (`version`, `updated_at`) comes first and together: PostgreSQL logs an update in place as the
-- bytes between the old and new row's common prefix and suffix, so a telemetry append logs those
-- two values and not the hash after them.
CREATE TABLE streams (
    stream_id          text PRIMARY KEY,
    version            bigint NOT NULL,
    updated_at         timestamptz NOT NULL DEFAULT now(),
    lifecycle_version  bigint NOT NULL DEFAULT 0,
    head_hash          bytea,
    tombstoned_at      timestamptz,
    created_at         timestamptz NOT NULL DEFAULT now()
);

-- Every event, appended by mf_append_many only. The log is partitioned by `segment` so that
-- retention drops a day of telemetry whole instead of deleting it row by row: no dead rows, no
-- VACUUM, no bloat (docs/retention.md).
CREATE TABLE events (
    global_position  bigint GENERATED ALWAYS AS IDENTITY,
    -- The writing transaction's id: a global position can commit out of order, so catch-up
    -- readers order by (tx_id, global_position) under the snapshot's xmin horizon.
    tx_id            xid8 NOT NULL DEFAULT pg_current_xact_id(),
    event_id         uuid NOT NULL,
    stream_id        text NOT NULL,
    stream_version   bigint NOT NULL,
    event_type       text NOT NULL,
    event_class      text NOT NULL
        CONSTRAINT events_event_class_check CHECK (event_class IN ('lifecycle', 'observation')),
    schema_version   integer NOT NULL,
    -- The event as jsonb (every lifecycle event, readable in SQL), or NULL where `body` holds it.
    data             jsonb,
    metadata         jsonb,
    recorded_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Tamper evidence for lifecycle events: hash = sha256(prev_hash || canonical bytes).
    prev_hash        bytea,
    hash             bytea,
    -- The central clock's receive time of an observation (metadata.received_at), as a column so
    -- that retention finds old observations by index.
    received_at      timestamptz,
    -- The UTC day an observation was received, where that day has a segment of its own;
    -- 'infinity' (the permanent segment) for everything else.
    segment          date NOT NULL DEFAULT 'infinity',
    -- An observation stored compact (ledger/compact.py): its metadata and payload as bytes that
    -- PostgreSQL neither parses nor compresses again; `data` and `metadata` are NULL then.
    body             bytea,
    -- Of a node's telemetry snapshot stored compact: the digest of the GPUs it samples
    -- (mf_sampled), which retention compares instead of reading the snapshot.
    sampled          uuid,
    CONSTRAINT events_body_check CHECK (CASE WHEN body IS NULL THEN data IS NOT NULL AND metadata IS NOT NULL
                                             ELSE data IS NULL AND metadata IS NULL
                                                  AND event_class = 'observation' END),
    -- A partitioned table's unique keys contain its partition key. Lifecycle events are all in
    -- the permanent segment, so their event ids and stream versions are unique by these keys
    -- alone; a stream's versions across segments are unique because every append holds the
    -- stream's lock and advances `streams.version`.
    CONSTRAINT events_pkey PRIMARY KEY (global_position, segment),
    CONSTRAINT events_event_id_key UNIQUE (event_id, segment),
    CONSTRAINT events_stream_version_key UNIQUE (stream_id, stream_version, segment)
) PARTITION BY RANGE (segment);

-- Every append compresses its payloads (an 8-GPU snapshot is about 7 KB of JSON); lz4 does it
-- several times faster than the default pglz. The segments take it from here (LIKE events
-- INCLUDING COMPRESSION).
DO $$
BEGIN
    IF mf_has_lz4() THEN
        ALTER TABLE events ALTER COLUMN data SET COMPRESSION lz4,
                           ALTER COLUMN metadata SET COMPRESSION lz4;
    END IF;
END;
$$;

-- The gap-safe read walks the log in commit order.
CREATE INDEX events_tx_position_idx ON events (tx_id, global_position);
-- One stream's events in commit order (a read of the log filtered by stream), and one node's
-- observations by the time they were received (a GPU's or a host's telemetry history).
-- A stream's key: both are keyed by the stream's eight-byte key (mf_stream_key), not its id. A day
-- segment takes every node's snapshots at once, each at the end of its node's entries, so a full
-- leaf page splits in half and these indexes stay about two thirds full until the day is sealed:
-- an entry of 36 or 28 bytes in place of 68 or 60 is what keeps them small. Two streams may share
-- a key, so a read by one of them checks the stream id too, written
-- `(stream_id = $1 OR mf_stream_key(stream_id) <> mf_stream_key($1))` beside the key's condition
-- (the second half never holds there): PostgreSQL takes `stream_id = $1` and the key's condition
-- as independent, expects a node's thousands of rows to be a handful and sorts them all for one
-- page; this way its estimate is the key's and it walks the index in order.
CREATE INDEX events_stream_tx_idx ON events (mf_stream_key(stream_id), tx_id, global_position);
CREATE INDEX events_stream_observation_received_idx ON events (mf_stream_key(stream_id), received_at)
    WHERE event_class = 'observation';
-- Reads of the log by the time events were recorded (point-in-time reads).
CREATE INDEX events_recorded_at_idx ON events (recorded_at);

-- The log's day segments (mf_ensure_segments makes them ahead of time; retention lifts a day from
-- here before it retires the day's partition, so that no append lands on it any more).
-- `sealed_at`: when the day's indexes were rebuilt packed, once the day was over (ledger/sealing.py).
CREATE TABLE event_segments (
    day         date PRIMARY KEY,
    partition   text NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    sealed_at   timestamptz
);

-- The permanent segment: every lifecycle event, every observation received on a day without a
-- segment of its own, and the observations retention keeps past their day (each node's and each
-- GPU's newest sample). Made as a table of its own and then attached, as the day segments are,
-- with its indexes named as ledger/migrations/0004 leaves them on an upgraded database: one name
-- for each index whichever way a database came to this version.
CREATE TABLE events_permanent (LIKE events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING COMPRESSION);
CREATE INDEX events_permanent_tx_position_idx ON events_permanent (tx_id, global_position);
CREATE INDEX events_permanent_stream_tx_idx
    ON events_permanent (mf_stream_key(stream_id), tx_id, global_position);
-- Retention finds the permanent segment's observations received before its cutoff (a day segment
-- goes whole, so its observations need no such index: one index entry less per snapshot).
CREATE INDEX events_permanent_observation_received_idx ON events_permanent (received_at)
    WHERE event_class = 'observation';
CREATE INDEX events_permanent_stream_observation_received_idx
    ON events_permanent (mf_stream_key(stream_id), received_at) WHERE event_class = 'observation';
-- Reads of the log filtered by event type, on the permanent segment alone: the day segments hold
-- telemetry snapshots only, which a read by type finds by walking them in commit order (they are
-- most of every day), so an index of their one type would be an entry per snapshot no read needs.
-- A read whose types are all lifecycle types names the segment (ledger/reading.py).
CREATE INDEX events_permanent_type_idx ON events_permanent (event_type, global_position);
CREATE INDEX events_permanent_recorded_at_idx ON events_permanent (recorded_at);
-- A GPU's lifecycle events by its UUID, in commit order (its history across every node it was
-- in), and the failures of every GPU (health changes into `failed`): lifecycle events all live in
-- the permanent segment, so these are on it alone and the reads name the segment
-- (docs/lemons.md). Telemetry never enters them.
CREATE INDEX events_permanent_gpu_uuid_idx
    ON events_permanent ((coalesce(data->>'uuid', data->>'accelerator_uuid')), tx_id, global_position)
    WHERE event_class = 'lifecycle';
CREATE INDEX events_permanent_gpu_failed_idx
    ON events_permanent (global_position)
    WHERE event_type = 'ACCELERATOR_HEALTH_CHANGED' AND data->>'after' = 'failed';
ALTER TABLE events ATTACH PARTITION events_permanent FOR VALUES FROM ('infinity') TO (MAXVALUE);
COMMENT ON COLUMN events.body IS
    'A compact observation (ledger/compact.py): msgpack [format, metadata, payload], format 1, 2, 3 or 4.';

-- The GPU sets compact snapshots of format 3 name by their `sampled` digest: a node's GPU UUIDs,
-- distinct, in byte order, joined by ',' (what the digest is the md5 of, which the check holds).
-- A snapshot lists each GPU as its index here instead of its UUID (16 bytes each). Written with
-- the first snapshot of a set (ledger/gpu_sets.py), never changed, never deleted: about one row
-- per node, part of the log as much as the snapshots are (docs/storage.md).
CREATE TABLE gpu_sets (
    sampled     uuid PRIMARY KEY,
    gpus        text NOT NULL,
    -- The writing transaction: a writer trusts a set another transaction committed, and one of
    -- its own only within its transaction (which may yet roll back).
    tx_id       xid8 NOT NULL DEFAULT pg_current_xact_id(),
    CONSTRAINT gpu_sets_digest_check CHECK (md5(gpus)::uuid = sampled)
);

-- ---------------------------------------------------------------------------------------------
-- Projections (read models). Every table below is derived from the log and rebuilt from it by
-- `modelforge-hw rebuild`; none holds truth of its own.
--
-- The rows every agent report rewrites are stored so that a report updates them in place:
-- * fillfactor 50: a page keeps room for the new versions of its rows, so an update stays on its
--   page (a HOT update: no new index entry, and no lock record for moving the row to another
--   page). With the default 100 the pages are full and about half of the telemetry updates move
--   their row, with more WAL per report (docs/performance.md). These tables are one row per node,
--   accelerator or agent stream, so the cost is tables twice as large (about 20 MB at 10,000
--   nodes). `rebuild`'s new tables carry the same settings (projections/rebuild.py).
-- * the folded state stays in its row, compressed: about 9.5 KB of JSON, 2.2 KB compressed, just
--   over the 2 KB at which PostgreSQL moves a value out of line, where every report would write
--   two TOAST chunks with their index entries and delete the previous two. toast_tuple_target =
--   8160 makes PostgreSQL compress the row only down to a page instead of 2 KB. (STORAGE MAIN on
--   the column does not do it: PostgreSQL then first moves the row's other values, the stream
--   id, out of line.)
-- ---------------------------------------------------------------------------------------------

-- Each projection's folded state per stream: its checkpoint (the stream version and global
-- position it has folded up to) and the state the next event is folded onto. The state is the
-- projection's own encoding as bytes: only the projection reads it, and PostgreSQL parsing a node's
-- state (about 10 KB) into jsonb on every write and printing it back on every read costs a third
-- of its CPU per agent report (docs/performance.md).
CREATE TABLE projection_state (
    projection      text NOT NULL,
    stream_id       text NOT NULL,
    stream_version  bigint NOT NULL,
    position        bigint NOT NULL,
    state           bytea NOT NULL,
    PRIMARY KEY (projection, stream_id)
) WITH (fillfactor = 50, toast_tuple_target = 8160);
-- The state arrives compressed (the projection's encoding, projections/framework.py): stored as
-- it comes, in its row up to `toast_tuple_target`, never compressed a second time.
ALTER TABLE projection_state ALTER COLUMN state SET STORAGE EXTERNAL;
COMMENT ON COLUMN projection_state.state IS
    'A stream''s folded state (projections/framework.py); the inventory''s keeps each GPU''s latest sample beside its accelerators.';
-- lz4 for a state PostgreSQL would compress (none while the column is EXTERNAL); upgraded
-- databases have it from version 4.
DO $$
BEGIN
    IF mf_has_lz4() THEN
        ALTER TABLE projection_state ALTER COLUMN state SET COMPRESSION lz4;
    END IF;
END;
$$;

-- Where each projection was last rebuilt to (a global catch-up checkpoint), and when.
CREATE TABLE projection_checkpoints (
    projection   text PRIMARY KEY,
    tx_id        xid8 NOT NULL,
    position     bigint NOT NULL,
    rebuilt_at   timestamptz NOT NULL
);

-- The shape each read model was last built with. A release that changes what a projection keeps
-- (its persisted state or its rows) raises that projection's `version` in code; `migrate` (and
-- `serve` at start) then rebuilds it from the log, so a read model is never compared with, or
-- served from, the shape of an older release. No row: the first release's shape (version 1).
CREATE TABLE projection_versions (
    projection  text PRIMARY KEY,
    version     integer NOT NULL,
    built_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE hw_nodes (
    node_id                 text PRIMARY KEY,
    identity_key            text,
    identity_source         text,
    hostname                text,
    display_name            text,
    status                  text NOT NULL,
    inventory_status        text NOT NULL,
    inventory_reasons       jsonb NOT NULL,
    accelerator_capability  text NOT NULL,
    fingerprint             text,
    fingerprint_position    bigint,
    os                      jsonb,
    cpu                     jsonb,
    memory_total_bytes      jsonb,
    driver_version          jsonb,
    cuda_driver_version     jsonb,
    source                  text,
    first_seen_at           timestamptz,
    decommissioned_at       timestamptz,
    lifecycle_version       bigint NOT NULL,
    -- When the server received the node's last report, once the decommission has removed its
    -- telemetry row (hw_host_telemetry.received_at holds it until then; here, every report
    -- would rewrite this row). NULL for a node that is not decommissioned.
    final_received_at       timestamptz
) WITH (fillfactor = 50);
CREATE INDEX hw_nodes_identity_idx ON hw_nodes (identity_key);
-- The console lists nodes by hostname, a page at a time (api/http/console).
CREATE INDEX hw_nodes_hostname_idx ON hw_nodes ((coalesce(hostname, '')), node_id);

-- `health_*`: the GPU's health verdict (docs/gpu-health.md): healthy | degraded | failed, the
-- action it calls for and why; and the XIDs the ledger remembers for the GPU ({code, at}, oldest
-- first), which the API and /metrics show.
CREATE TABLE hw_accelerators (
    accelerator_id       text PRIMARY KEY,
    node_id              text NOT NULL,
    uuid                 text NOT NULL,
    status               text NOT NULL,
    device_index         jsonb NOT NULL,
    pci_bus_id           jsonb NOT NULL,
    name                 jsonb NOT NULL,
    memory_total_bytes   jsonb NOT NULL,
    compute_capability   jsonb NOT NULL,
    mig_mode             jsonb NOT NULL,
    driver_version       jsonb NOT NULL,
    cuda_driver_version  jsonb NOT NULL,
    first_seen_at        timestamptz NOT NULL,
    last_seen_at         timestamptz NOT NULL,
    missing_since        timestamptz,
    position             bigint NOT NULL,
    health_status        text NOT NULL DEFAULT 'healthy',
    health_action        text NOT NULL DEFAULT 'none',
    health_reasons       jsonb NOT NULL DEFAULT '[]',
    health_xids          jsonb NOT NULL DEFAULT '[]',
    UNIQUE (node_id, uuid)
);
CREATE INDEX hw_accelerators_status_idx ON hw_accelerators (status, accelerator_id);
-- `?health=failed` pages a few GPUs out of a large fleet without reading the others.
CREATE INDEX hw_accelerators_health_idx ON hw_accelerators (health_status, accelerator_id);
-- One GPU UUID's rows: one per node it was ever in (its history and its time in service).
CREATE INDEX hw_accelerators_uuid_idx ON hw_accelerators (uuid);

CREATE TABLE hw_node_storage (
    node_id      text NOT NULL,
    mount        text NOT NULL,
    used_bytes   jsonb NOT NULL,
    total_bytes  jsonb NOT NULL,
    PRIMARY KEY (node_id, mount)
) WITH (fillfactor = 50);

-- Also the node's liveness: the central receive time of its newest report, and its clock skew.
CREATE TABLE hw_host_telemetry (
    node_id             text PRIMARY KEY,
    metrics             jsonb NOT NULL,
    observed_at         timestamptz,
    received_at         timestamptz,
    clock_skew_seconds  double precision,
    position            bigint NOT NULL
) WITH (fillfactor = 50);

-- Each GPU's newest sample where it is not in its node's latest snapshot (a GPU left out of the
-- latest scan, gone missing, or sampled by an event of its own in an older log): when it was
-- taken and received, and the event that holds it. A GPU without a row has its sample in the
-- snapshot hw_host_telemetry points at, so a steady report rewrites no row here. The sample
-- itself (metrics and health signals) is read from that event (api/services/reads/samples.py).
-- Retention always keeps each GPU's newest sample (docs/retention.md), so the event is there.
CREATE TABLE hw_accelerator_telemetry (
    accelerator_id  text PRIMARY KEY,
    node_id         text NOT NULL,
    observed_at     timestamptz,
    received_at     timestamptz,
    position        bigint NOT NULL
) WITH (fillfactor = 50);

-- A node's telemetry hours: each closed hour of received time of its log's snapshots stored again
-- as columns, per subject ('' the hour's positions, times and host values; else a GPU UUID), for
-- the history reads (ledger/telemetry_hours.py). A cache of the log: a read uses an hour only
-- where the log still holds `observations` rows in it.
CREATE TABLE telemetry_hours (
    node_id       text NOT NULL,
    hour          timestamptz NOT NULL,
    subject       text NOT NULL,
    format        smallint NOT NULL,
    observations  integer NOT NULL,
    body          bytea,
    PRIMARY KEY (node_id, hour, subject)
);
DO $$
BEGIN
    IF mf_has_lz4() THEN
        ALTER TABLE telemetry_hours ALTER COLUMN body SET COMPRESSION lz4;
    END IF;
END;
$$;

CREATE TABLE hw_fingerprints (
    node_id      text PRIMARY KEY,
    fingerprint  text NOT NULL,
    position     bigint NOT NULL
);

CREATE TABLE hw_inventory_runs (
    node_id      text PRIMARY KEY,
    outcome      text NOT NULL,
    status       text NOT NULL,
    reasons      jsonb NOT NULL,
    nvml_status  text,
    at           timestamptz,
    position     bigint NOT NULL
) WITH (fillfactor = 50);

-- ---------------------------------------------------------------------------------------------
-- Agent plane (docs/NODE_AGENT_PROTOCOL.md): enrollment tokens and node credentials are read
-- models like the ones above (derived from lifecycle events by projections/agent.py, rebuilt by
-- `modelforge-hw rebuild`); they hold SHA-256 digests of 256-bit random secrets, never a secret.
-- ---------------------------------------------------------------------------------------------

CREATE TABLE hw_enrollment_tokens (
    token_id        text PRIMARY KEY,
    secret_sha256   text NOT NULL,
    description     text NOT NULL,
    uses            integer NOT NULL,
    uses_left       integer NOT NULL,
    created_at      timestamptz,
    expires_at      timestamptz,
    last_used_at    timestamptz,
    revoked_at      timestamptz,
    revoked_reason  text,
    stream_version  bigint NOT NULL,
    position        bigint NOT NULL
);

CREATE TABLE hw_node_credentials (
    credential_id        text PRIMARY KEY,
    node_id              text NOT NULL,
    identity_key         text NOT NULL,
    hostname             text NOT NULL,
    secret_sha256        text NOT NULL,
    enrollment_token_id  text NOT NULL,
    issued_at            timestamptz NOT NULL,
    revoked_at           timestamptz,
    revoked_reason       text,
    position             bigint NOT NULL
);
CREATE INDEX hw_node_credentials_node_idx ON hw_node_credentials (node_id);

-- Work leases (docs/NODE_DECOMMISSION.md): work that depends on a node, held in the node's stream
-- (WORK_LEASE_ACQUIRED / WORK_LEASE_RELEASED) and shown here while unreleased. An active one (not
-- released, `expires_at` null or in the future) blocks the node's decommission. A read model of
-- the inventory projection, rebuilt like the tables above.
CREATE TABLE hw_work_leases (
    lease_id     text PRIMARY KEY,
    node_id      text NOT NULL,
    owner        text NOT NULL,
    reason       text NOT NULL,
    acquired_at  timestamptz NOT NULL,
    expires_at   timestamptz,
    actor        text,
    position     bigint NOT NULL
);
CREATE INDEX hw_work_leases_node_idx ON hw_work_leases (node_id);

-- Write-side, not a read model: the last accepted sequence per (node, agent stream), checked and
-- advanced in the transaction that appends the report's events, under the node's stream lock.
-- Transport state (like a consumer offset): the events carry stream, sequence and body digest in
-- their metadata for audit, but retention prunes old observation events, so a rebuild from the
-- log could move a position backwards and reopen the replay window; `rebuild` never touches it.
-- `recent`: the newest accepted sequences with the SHA-256 of each one's body, so an unchanged
-- retry of one of them is answered 200 without appending anything: per sequence 8 bytes of its
-- number (big-endian) and the 32 bytes of the digest, newest first (api/services/positions.py).
-- A report puts its entry in front of the ones stored before, and `recent` is the last column, so
-- the row's update changes the scalars and that entry only: PostgreSQL logs an update in place as
-- the bytes between the old and new row's common prefix and suffix (about 100 bytes of WAL, where
-- the whole window was 1,300). At most 46 entries: the row stays under the 2 KB at which
-- PostgreSQL would compress it or move `recent` to TOAST.
CREATE TABLE agent_stream_positions (
    node_id           text NOT NULL,
    stream            text NOT NULL,
    last_sequence     bigint NOT NULL,
    reports           bigint NOT NULL,
    skipped           bigint NOT NULL,
    last_observed_at  timestamptz,
    last_received_at  timestamptz NOT NULL,
    recent            bytea NOT NULL,
    PRIMARY KEY (node_id, stream)
) WITH (fillfactor = 50);

-- ---------------------------------------------------------------------------------------------
-- Operators and the change feed
-- ---------------------------------------------------------------------------------------------

-- Scoped operator tokens. The admin token (MODELFORGE_ADMIN_TOKEN / the state directory) is the
-- one full-scope token; rows here are narrower ones, e.g. `viewer` (reads only). Only the SHA-256
-- of the secret is kept; the token itself is shown once when it is created.
CREATE TABLE operator_tokens (
    token_id       text PRIMARY KEY,
    scope          text NOT NULL CHECK (scope IN ('viewer')),
    secret_sha256  text NOT NULL,
    description    text NOT NULL DEFAULT '',
    created_at     timestamptz NOT NULL DEFAULT now(),
    expires_at     timestamptz,
    revoked_at     timestamptz
);

-- The backends listening to the change feed (ledger/feed.py): appends notify only while one is
-- registered (mf_notify_log says why). A LogFeed registers its backend when it starts listening
-- and deregisters when it stops; rows of backends that are gone count for nothing. A commit that
-- races a registration wakes its reader at the feed's fallback poll instead.
CREATE TABLE mf_feed_listeners (
    pid            integer PRIMARY KEY,
    backend_start  timestamptz NOT NULL
);

-- ---------------------------------------------------------------------------------------------
-- Webhooks
-- ---------------------------------------------------------------------------------------------

-- Webhook subscriptions (docs/integrations.md). Write-side transport state, like
-- agent_stream_positions: the subscription's creation and removal are lifecycle events in the
-- stream `webhooks` (the audit), written in the same transaction as the row; the row holds what
-- delivery needs and the log cannot: its cursor (the last event the receiver acknowledged, in
-- commit order), its retry state and counters. `rebuild` never touches these tables.
CREATE TABLE webhook_subscriptions (
    subscription_id    text PRIMARY KEY,
    url                text NOT NULL,
    event_types        text[] NOT NULL,
    event_classes      text[] NOT NULL,
    node_id            text,
    description        text NOT NULL DEFAULT '',
    state              text NOT NULL DEFAULT 'active'
        CONSTRAINT webhook_subscriptions_state_check CHECK (state IN ('active', 'failing', 'deleted')),
    created_at         timestamptz NOT NULL DEFAULT now(),
    deleted_at         timestamptz,
    cursor_tx_id       xid8 NOT NULL,
    cursor_position    bigint NOT NULL,
    -- Failed attempts in a row at the event after the cursor, and when the next one is due.
    attempts           integer NOT NULL DEFAULT 0,
    next_attempt_at    timestamptz,
    failing_since      timestamptz,
    last_error         text,
    delivered          bigint NOT NULL DEFAULT 0,
    rejected           bigint NOT NULL DEFAULT 0,
    retried            bigint NOT NULL DEFAULT 0,
    last_delivered_at  timestamptz,
    last_position      bigint
);

-- The signing secret of each subscription, apart from everything that is listed, logged or
-- recorded as an event. Kept as given (not a digest): the server signs every delivery with it.
CREATE TABLE webhook_secrets (
    subscription_id  text PRIMARY KEY REFERENCES webhook_subscriptions ON DELETE CASCADE,
    secret           bytea NOT NULL
);

-- Recent delivery attempts per subscription (the delivery worker keeps the newest few hundred).
CREATE TABLE webhook_deliveries (
    delivery_id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscription_id  text NOT NULL,
    global_position  bigint NOT NULL,
    event_type       text NOT NULL,
    attempt          integer NOT NULL,
    outcome          text NOT NULL
        CONSTRAINT webhook_deliveries_outcome_check
        CHECK (outcome IN ('delivered', 'retrying', 'rejected', 'failing')),
    status_code      integer,
    duration_ms      double precision NOT NULL,
    response_body    text,
    error            text,
    attempted_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX webhook_deliveries_subscription_idx ON webhook_deliveries (subscription_id, delivery_id);

-- ---------------------------------------------------------------------------------------------
-- Functions and triggers, in the order every migrate installs them (a SQL function after the
-- ones it calls).
-- ---------------------------------------------------------------------------------------------

\ir sql/functions/mf_event_hash.sql
\ir sql/functions/mf_lock_streams.sql
\ir sql/functions/mf_open_streams.sql
\ir sql/functions/mf_append_positioned.sql
\ir sql/functions/mf_append_many.sql
\ir sql/functions/mf_append_kept.sql
\ir sql/functions/mf_append_folded.sql
\ir sql/functions/mf_require.sql
\ir sql/functions/mf_advance_positions.sql
\ir sql/functions/mf_append.sql
\ir sql/functions/mf_ensure_segments.sql
\ir sql/functions/mf_read_changes.sql
\ir sql/functions/mf_sampled.sql
\ir sql/functions/mf_refuse_lifecycle_change.sql
\ir sql/functions/mf_refuse_truncate.sql
\ir sql/functions/mf_notify_log.sql
\ir sql/functions/mf_refuse_gpu_set_change.sql

\ir sql/triggers/events_lifecycle_immutable.sql
\ir sql/triggers/events_no_truncate.sql
\ir sql/triggers/events_permanent_no_truncate.sql
\ir sql/triggers/events_notify_log.sql
\ir sql/triggers/gpu_sets_immutable.sql
\ir sql/triggers/gpu_sets_no_truncate.sql

-- This file is schema version 23: a database made from it has what every numbered step gives.
INSERT INTO schema_version (version) SELECT generate_series(1, 23);
