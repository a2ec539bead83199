-- Version 4: the log is partitioned by its `segment`, so that retention drops a day of telemetry
-- whole instead of deleting it row by row (no dead rows, no VACUUM, no bloat; docs/retention.md).
--
--   * `events_permanent` (segment 'infinity'): every lifecycle event, every observation received
--     on a day without a segment of its own, and the observations retention keeps past their day
--     (each node's and each GPU's newest sample). It is the unpartitioned `events` table of
--     version 3, attached as it is: an upgrade copies no event.
--   * `events_dYYYYMMDD` (segment = the UTC day the central clock received the observation):
--     created ahead by `mf_ensure_segments`, listed in `event_segments`, detached and dropped by
--     retention once the whole day is older than the cutoff.
--
-- A partitioned table's unique keys must contain the partition key: `(event_id, segment)` and
-- `(stream_id, stream_version, segment)`. Lifecycle events all have segment 'infinity', so their
-- event ids and stream versions stay unique by the database itself; stream versions across
-- segments are unique because every append holds its stream's lock and advances `streams.version`.
--
-- The triggers of the new log are code: `migrate` installs them after the steps, on every run
-- (ledger/sql/triggers/). This step removes the old table's, which would otherwise stay on the
-- permanent segment beside the ones cloned from the new log.

-- What a version-4 database has besides the partitioned log, where a version-3 database may lack
-- it; each statement changes nothing where its object is there already.
-- The console lists nodes by hostname, a page at a time.
CREATE INDEX IF NOT EXISTS hw_nodes_hostname_idx ON hw_nodes ((coalesce(hostname, '')), node_id);
-- GPU health verdicts and the XIDs the ledger remembers (the inventory projection's rows).
ALTER TABLE hw_accelerators
    ADD COLUMN IF NOT EXISTS health_status text NOT NULL DEFAULT 'healthy',
    ADD COLUMN IF NOT EXISTS health_action text NOT NULL DEFAULT 'none',
    ADD COLUMN IF NOT EXISTS health_reasons jsonb NOT NULL DEFAULT '[]',
    ADD COLUMN IF NOT EXISTS health_xids jsonb NOT NULL DEFAULT '[]';
CREATE INDEX IF NOT EXISTS hw_accelerators_health_idx ON hw_accelerators (health_status, accelerator_id);
-- Streams are locked by mf_lock_streams and opened by mf_open_streams, one stream or many.
DROP FUNCTION IF EXISTS mf_lock_stream(text);
DROP FUNCTION IF EXISTS mf_open_stream(text, text);

CREATE TABLE event_segments (
    day         date PRIMARY KEY,
    partition   text NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now()
);

DO $$
DECLARE
    v_last  bigint;
    v_name  text;
BEGIN
    -- lz4 for the payloads where this PostgreSQL has it; the permanent segment keeps the setting.
    BEGIN
        ALTER TABLE events ALTER COLUMN data SET COMPRESSION lz4,
                           ALTER COLUMN metadata SET COMPRESSION lz4;
    EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN NULL;
    END;

    ALTER TABLE events RENAME TO events_permanent;
    ALTER TABLE events_permanent RENAME CONSTRAINT events_pkey TO events_permanent_position_key;
    ALTER TABLE events_permanent RENAME CONSTRAINT events_event_id_key TO events_permanent_event_id_key;
    ALTER TABLE events_permanent RENAME CONSTRAINT events_stream_version_key
        TO events_permanent_stream_version_key;
    FOREACH v_name IN ARRAY ARRAY['tx_position', 'stream_tx', 'observation_received', 'type',
                                  'recorded_at'] LOOP
        EXECUTE format('ALTER INDEX events_%s_idx RENAME TO events_permanent_%s_idx', v_name, v_name);
    END LOOP;
    DROP TRIGGER IF EXISTS events_lifecycle_immutable ON events_permanent;
    DROP TRIGGER IF EXISTS events_no_truncate ON events_permanent;
    DROP TRIGGER IF EXISTS events_notify_log ON events_permanent;

    SELECT max(global_position) INTO v_last FROM events_permanent;
    ALTER TABLE events_permanent ALTER COLUMN global_position DROP IDENTITY;
    ALTER TABLE events_permanent ADD COLUMN segment date NOT NULL DEFAULT 'infinity';

    CREATE TABLE events (
        global_position  bigint GENERATED ALWAYS AS IDENTITY,
        tx_id            xid8 NOT NULL DEFAULT pg_current_xact_id(),
        event_id         uuid NOT NULL,
        stream_id        text NOT NULL,
        stream_version   bigint NOT NULL,
        event_type       text NOT NULL,
        event_class      text NOT NULL
            CONSTRAINT events_event_class_check CHECK (event_class IN ('lifecycle', 'observation')),
        schema_version   integer NOT NULL,
        data             jsonb NOT NULL,
        metadata         jsonb NOT NULL,
        recorded_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
        prev_hash        bytea,
        hash             bytea,
        received_at      timestamptz,
        segment          date NOT NULL DEFAULT 'infinity'
    ) PARTITION BY RANGE (segment);
    BEGIN
        ALTER TABLE events ALTER COLUMN data SET COMPRESSION lz4;
        ALTER TABLE events ALTER COLUMN metadata SET COMPRESSION lz4;
    EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN NULL;
    END;

    ALTER TABLE events ATTACH PARTITION events_permanent FOR VALUES FROM ('infinity') TO (MAXVALUE);
    IF v_last IS NULL THEN
        PERFORM setval(pg_get_serial_sequence('events', 'global_position'), 1, false);
    ELSE
        PERFORM setval(pg_get_serial_sequence('events', 'global_position'), v_last);
    END IF;

    -- The keys, with the segment, in place of the permanent partition's old ones (without it;
    -- in this one transaction, so the log is never without them). Builds three indexes there.
    ALTER TABLE events_permanent DROP CONSTRAINT events_permanent_position_key;
    ALTER TABLE events_permanent DROP CONSTRAINT events_permanent_event_id_key;
    ALTER TABLE events_permanent DROP CONSTRAINT events_permanent_stream_version_key;
    ALTER TABLE events ADD CONSTRAINT events_pkey PRIMARY KEY (global_position, segment);
    ALTER TABLE events ADD CONSTRAINT events_event_id_key UNIQUE (event_id, segment);
    ALTER TABLE events ADD CONSTRAINT events_stream_version_key
        UNIQUE (stream_id, stream_version, segment);

    -- The same indexes as before, on the parent: each adopts the permanent partition's own.
    CREATE INDEX events_tx_position_idx ON events (tx_id, global_position);
    CREATE INDEX events_stream_tx_idx ON events (stream_id, tx_id, global_position);
    CREATE INDEX events_observation_received_idx ON events (received_at)
        WHERE event_class = 'observation';
    CREATE INDEX events_type_idx ON events (event_type, global_position);
    CREATE INDEX events_recorded_at_idx ON events (recorded_at);
END;
$$;
