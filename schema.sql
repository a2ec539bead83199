-- ModelForge hardware plane: the whole database schema.
-- Applied by `modelforge-hw migrate` (and by `serve` on start). Every statement is idempotent:
-- running this file twice is no error and changes nothing.

CREATE TABLE IF NOT EXISTS schema_version (
    version     integer PRIMARY KEY,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- ---------------------------------------------------------------------------------------------
-- The event log
-- ---------------------------------------------------------------------------------------------

-- One row per stream (one stream per compute node). `version` is the number of the stream's last
-- event; `lifecycle_version` counts its lifecycle events only (the node's "generation": telemetry
-- does not move it). `head_hash` is the hash of the newest lifecycle event, kept beside the stream
-- so that an edit to the newest event is caught too.
CREATE TABLE IF NOT EXISTS streams (
    stream_id          text PRIMARY KEY,
    version            bigint NOT NULL,
    lifecycle_version  bigint NOT NULL DEFAULT 0,
    head_hash          bytea,
    tombstoned_at      timestamptz,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS events (
    global_position  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The writing transaction's id: a global position can commit out of order, so catch-up
    -- readers order by (tx_id, global_position) under the snapshot's xmin horizon.
    tx_id            xid8 NOT NULL DEFAULT pg_current_xact_id(),
    event_id         uuid NOT NULL,
    stream_id        text NOT NULL,
    stream_version   bigint NOT NULL,
    event_type       text NOT NULL,
    event_class      text NOT NULL CHECK (event_class IN ('lifecycle', 'observation')),
    schema_version   integer NOT NULL,
    data             jsonb NOT NULL,
    metadata         jsonb NOT NULL,
    recorded_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Tamper evidence for lifecycle events: hash = sha256(prev_hash || canonical bytes).
    prev_hash        bytea,
    hash             bytea,
    CONSTRAINT events_event_id_key UNIQUE (event_id),
    CONSTRAINT events_stream_version_key UNIQUE (stream_id, stream_version)
);

-- Every ALTER TABLE in this file runs only where the catalog says it changes something: an ALTER
-- takes its table's ACCESS EXCLUSIVE lock even when it changes nothing (ADD COLUMN IF NOT EXISTS
-- of a column that exists, SET COMPRESSION to the method set), and this file runs at every server
-- start, beside servers writing and readers reading. Waiting for a long reader (a backup's
-- pg_dump holds every table for its whole length), it queued every append and read of the table
-- behind it (tests/test_upgrade.py).

-- Whether this PostgreSQL was built with lz4, asked without touching a table: on a server built
-- without it (the embedded PostgreSQL of the tests is one) SET COMPRESSION lz4 fails, but only
-- after taking its table's ACCESS EXCLUSIVE lock, at every start.
CREATE OR REPLACE FUNCTION mf_has_lz4() RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_was  text := current_setting('default_toast_compression');
BEGIN
    PERFORM set_config('default_toast_compression', 'lz4', true);
    PERFORM set_config('default_toast_compression', v_was, true);
    RETURN true;
EXCEPTION WHEN invalid_parameter_value OR feature_not_supported THEN
    RETURN false;
END;
$$;

-- The central clock's receive time of the observation (metadata.received_at), as a column so the
-- retention policy can find old observation events by index.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'events'::regclass
                   AND attname = 'received_at' AND NOT attisdropped) THEN
        ALTER TABLE events ADD COLUMN IF NOT EXISTS received_at timestamptz;
    END IF;
END;
$$;

-- Every append compresses its payloads (an 8-GPU snapshot is about 7 KB of JSON); lz4 does it
-- several times faster than the default pglz (ignored where the server was built without lz4).
DO $$
BEGIN
    IF mf_has_lz4() AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'events'::regclass
               AND attname IN ('data', 'metadata') AND attcompression <> 'l') THEN
        ALTER TABLE events ALTER COLUMN data SET COMPRESSION lz4;
        ALTER TABLE events ALTER COLUMN metadata SET COMPRESSION lz4;
    END IF;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN NULL;
END;
$$;

CREATE INDEX IF NOT EXISTS events_tx_position_idx ON events (tx_id, global_position);
CREATE INDEX IF NOT EXISTS events_stream_tx_idx ON events (stream_id, tx_id, global_position);
CREATE INDEX IF NOT EXISTS events_observation_received_idx ON events (received_at)
    WHERE event_class = 'observation';
CREATE INDEX IF NOT EXISTS events_type_idx ON events (event_type, global_position);
CREATE INDEX IF NOT EXISTS events_recorded_at_idx ON events (recorded_at);

-- Lifecycle events are permanent: the database itself refuses to change or remove them.
CREATE OR REPLACE FUNCTION mf_refuse_lifecycle_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'lifecycle event % (stream %, version %) is immutable: % refused',
        OLD.global_position, OLD.stream_id, OLD.stream_version, TG_OP
        USING ERRCODE = 'restrict_violation';
END;
$$;

CREATE OR REPLACE TRIGGER events_lifecycle_immutable
    BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW WHEN (OLD.event_class = 'lifecycle')
    EXECUTE FUNCTION mf_refuse_lifecycle_change();

CREATE OR REPLACE FUNCTION mf_refuse_truncate() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the event log cannot be truncated' USING ERRCODE = 'restrict_violation';
END;
$$;

CREATE OR REPLACE TRIGGER events_no_truncate
    BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION mf_refuse_truncate();

-- The canonical bytes of an event, hashed into its stream's chain. jsonb's text form is
-- deterministic for a given value, so the hash can be recomputed from the stored row alone.
-- STABLE, as its body is (concat_ws is), so that PostgreSQL inlines it into its callers' plans:
-- declared IMMUTABLE it was not inlined, and every transaction that appended a lifecycle event
-- parsed and planned this body again (6 % of the database's CPU for a one-report append,
-- docs/performance.md, issue 12, ninth step). The hash itself is the same.
CREATE OR REPLACE FUNCTION mf_event_hash(
    p_prev_hash bytea, p_stream_id text, p_stream_version bigint, p_event_id uuid,
    p_event_type text, p_schema_version integer, p_data jsonb, p_metadata jsonb,
    p_recorded_at timestamptz
) RETURNS bytea
LANGUAGE sql STABLE AS $$
    SELECT sha256(
        coalesce(p_prev_hash, ''::bytea) ||
        convert_to(
            concat_ws(E'\x1f', p_stream_id, p_stream_version::text, p_event_id::text, p_event_type,
                      p_schema_version::text, p_data::text, p_metadata::text,
                      (extract(epoch FROM p_recorded_at) * 1000000)::bigint::text),
            'UTF8'))
$$;

-- mf_lock_stream (0.1-0.2) locked one stream; mf_open_streams below does that for one or many.
DROP FUNCTION IF EXISTS mf_lock_stream(text);

-- What every writer of streams takes first, for the rest of its transaction: the rebuild gate,
-- shared (`rebuild` holds it exclusively for its swap), then each stream's advisory lock in the
-- order given (callers sort the ids: one lock order for everyone, so no two batches deadlock).
CREATE OR REPLACE FUNCTION mf_lock_streams(p_stream_ids text[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_id  text;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(7305820111);
    FOREACH v_id IN ARRAY p_stream_ids LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(v_id, 0));
    END LOOP;
END;
$$;

-- Open streams for a unit of work (one stream) or a batch of them (group commit): the rebuild
-- gate (shared), each stream's advisory lock in the order given (callers sort the ids, so every
-- batch locks in one order and no two deadlock), then where each stream stands and the folded state
-- projection `p_projection` checkpointed for it, one row per id in the order given, all in one
-- round trip. A function, so the rows are read with a snapshot taken after the locks are granted
-- (a single SELECT would read with the snapshot of its start, before a wait for a lock).
-- Schema version 4 returned the state as text (a jsonb column's); a function's result type can
-- only change by dropping it.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_proc WHERE proname = 'mf_open_streams'
               AND pg_get_function_result(oid) LIKE '%out_state text%') THEN
        DROP FUNCTION mf_open_streams(text[], text);
    END IF;
END;
$$;
-- The client may already hold some of the folded states (ledger/store.py keeps the states it
-- wrote): for each stream it names the checkpoint it holds, (stream version, position), and the
-- projection's rebuild it holds them from (projection_checkpoints.rebuilt_at; -infinity before
-- any). A checkpoint that is still the one stored comes back without its state (out_state NULL,
-- out_state_version set): a node's state is about 10 KB that PostgreSQL would decompress and send
-- and the client decode, on every report. A position is never reused (the log's sequence), so a
-- stream's checkpoint at the same version and position is the same fold of the same events; a
-- rebuild writes every state anew, and its new rebuilt_at sends them all again.
CREATE OR REPLACE FUNCTION mf_open_streams(p_stream_ids text[], p_projection text,
                                           p_known_versions bigint[], p_known_positions bigint[],
                                           p_known_rebuild timestamptz)
RETURNS TABLE (out_stream_id text, out_version bigint, out_lifecycle_version bigint,
               out_tombstoned_at timestamptz, out_state bytea, out_state_version bigint,
               out_state_position bigint, out_rebuild timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_rebuild  timestamptz;
BEGIN
    PERFORM mf_lock_streams(p_stream_ids);
    v_rebuild := coalesce((SELECT c.rebuilt_at FROM projection_checkpoints c
                           WHERE c.projection = p_projection), '-infinity');
    RETURN QUERY
        SELECT i.id, coalesce(s.version, 0), coalesce(s.lifecycle_version, 0), s.tombstoned_at,
               CASE WHEN ps.stream_version = i.kv AND ps.position = i.kp
                         AND v_rebuild = p_known_rebuild THEN NULL ELSE ps.state END,
               ps.stream_version, ps.position, v_rebuild
        FROM unnest(p_stream_ids, p_known_versions, p_known_positions) WITH ORDINALITY
             AS i(id, kv, kp, n)
        LEFT JOIN streams s ON s.stream_id = i.id
        LEFT JOIN projection_state ps ON ps.projection = p_projection AND ps.stream_id = i.id
        ORDER BY i.n;
END;
$$;

-- The two-argument form, which servers before the state cache call: every state sent.
CREATE OR REPLACE FUNCTION mf_open_streams(p_stream_ids text[], p_projection text)
RETURNS TABLE (out_stream_id text, out_version bigint, out_lifecycle_version bigint,
               out_tombstoned_at timestamptz, out_state bytea)
LANGUAGE sql AS $$
    SELECT o.out_stream_id, o.out_version, o.out_lifecycle_version, o.out_tombstoned_at, o.out_state
    FROM mf_open_streams(p_stream_ids, p_projection, NULL, NULL, NULL) o
$$;

-- Append events to streams: one round trip for one stream or a group commit's batch of them.
-- `p_counts[i]` events of the flat arrays go to `p_stream_ids[i]` (each id once) at
-- `p_expected_versions[i]` (NULL: any version). Per stream, as it has always been:
--   * the stream's pg_advisory_xact_lock (appends to different streams run in parallel), plus a
--     shared lock on the rebuild gate so `rebuild` can briefly hold every writer at its swap;
--     `p_locked` says the caller took them already (a group commit, in sorted order);
--   * optimistic concurrency: a stale expected version raises SQLSTATE MF409, writes nothing;
--   * idempotency by event_id: a stream's batch already stored whole returns its positions
--     (already_stored) and writes nothing; part of it stored raises MF422;
--   * a tombstoned stream takes no event (SQLSTATE MF410); NODE_DECOMMISSIONED tombstones it;
--   * lifecycle events are hash-chained per stream (mf_event_hash);
--   * an observation goes to the segment of the UTC day it was received, if that day has one.
-- Any refusal fails the whole call (and the caller's transaction). Every stream that takes its
-- events is written set-wise: one INSERT of all of them, one upsert of their streams, one
-- segment lookup per day, one recorded_at for the call. Written stream by stream, a batch cost a
-- function call, a streams read, an INSERT with its statement trigger and a streams upsert per
-- stream (docs/performance.md, issue 12, fifth step).
-- Rows: (stream index, 1-based; global_position; stream_version; already_stored; recorded_at).
--
-- Statements with fixed shapes keep cached plans; the lookups of already-stored events run only
-- for a retry, a conflict or a tombstone, by EXECUTE, so each is planned for the log as it is
-- then (a generic plan cached while the log was small would keep scanning it whole as it grows).
CREATE OR REPLACE FUNCTION mf_append_many(
    p_stream_ids text[], p_expected_versions bigint[], p_counts integer[], p_event_ids uuid[],
    p_event_types text[], p_event_classes text[], p_schema_versions integer[], p_data jsonb[],
    p_metadata jsonb[], p_locked boolean DEFAULT false
) RETURNS TABLE (out_stream_index integer, out_global_position bigint, out_stream_version bigint,
               out_already_stored boolean, out_recorded_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_streams      integer := coalesce(array_length(p_stream_ids, 1), 0);
    v_n            integer := coalesce(array_length(p_event_ids, 1), 0);
    v_current      bigint[];
    v_lifecycles   bigint[];
    v_heads        bytea[];
    v_tombstones   timestamptz[];
    v_write        boolean[];     -- per stream: its events are inserted by this call
    v_ends         timestamptz[]; -- per stream: the tombstone its batch sets (NODE_DECOMMISSIONED)
    v_take         boolean[];     -- per event: its stream writes
    v_head         bytea;
    v_prevs        bytea[];
    v_hashes       bytea[];
    v_index        integer[];
    v_versions     bigint[];
    v_segments     date[];
    v_day          date;
    v_seen_day     date;
    v_day_segment  date := 'infinity';
    v_now          timestamptz;
    v_out_index    integer[];
    v_out_position bigint[];
    v_out_version  bigint[];
    v_wanted       integer := 0;
    v_got          integer;
    v_existing     integer;
    v_lo           integer := 1;
    v_hi           integer;
    i              integer;
    j              integer;
    k              integer := 0;
BEGIN
    IF v_streams = 0 THEN
        RETURN;
    END IF;
    IF coalesce(array_length(p_expected_versions, 1), 0) <> v_streams
       OR coalesce(array_length(p_counts, 1), 0) <> v_streams
       OR (SELECT sum(c) FROM unnest(p_counts) AS c) IS DISTINCT FROM v_n::bigint
       OR (SELECT min(c) FROM unnest(p_counts) AS c) < 1
       OR (SELECT count(DISTINCT x) FROM unnest(p_stream_ids) AS x) <> v_streams THEN
        RAISE EXCEPTION 'an append names each stream once, with one count of at least 1 per stream '
                        'and as many events as the counts add up to' USING ERRCODE = '22023';
    END IF;
    IF NOT p_locked THEN
        PERFORM mf_lock_streams(p_stream_ids);
    END IF;
    -- Taken once the locks are held, so a stream's recorded_at never goes back.
    v_now := clock_timestamp();

    SELECT array_agg(coalesce(s.version, 0) ORDER BY u.n),
           array_agg(coalesce(s.lifecycle_version, 0) ORDER BY u.n),
           array_agg(s.head_hash ORDER BY u.n),
           array_agg(s.tombstoned_at ORDER BY u.n)
        INTO v_current, v_lifecycles, v_heads, v_tombstones
        FROM unnest(p_stream_ids) WITH ORDINALITY AS u(id, n)
        LEFT JOIN streams s ON s.stream_id = u.id;

    v_write := array_fill(true, ARRAY[v_streams]);
    v_ends := array_fill(NULL::timestamptz, ARRAY[v_streams]);
    v_take := array_fill(true, ARRAY[v_n]);
    v_index := array_fill(0, ARRAY[v_n]);
    v_versions := array_fill(0::bigint, ARRAY[v_n]);
    v_segments := array_fill('infinity'::date, ARRAY[v_n]);
    v_prevs := array_fill(NULL::bytea, ARRAY[v_n]);
    v_hashes := array_fill(NULL::bytea, ARRAY[v_n]);
    FOR i IN 1 .. v_streams LOOP
        v_hi := v_lo + p_counts[i] - 1;
        -- A stream that cannot take its batch may already hold it whole: a retry gets what it stored.
        IF v_tombstones[i] IS NOT NULL
           OR (p_expected_versions[i] IS NOT NULL AND v_current[i] <> p_expected_versions[i]) THEN
            EXECUTE 'SELECT count(*) FROM unnest($1) AS i(id) '
                    'WHERE EXISTS (SELECT 1 FROM events e WHERE e.event_id = i.id)'
                INTO v_existing USING p_event_ids[v_lo:v_hi];
            IF v_existing = p_counts[i] THEN
                v_write[i] := false;
            ELSIF v_existing > 0 THEN
                RAISE EXCEPTION 'part of this batch is already stored (% of % events)', v_existing,
                    p_counts[i] USING ERRCODE = 'MF422';
            ELSIF v_tombstones[i] IS NOT NULL THEN
                RAISE EXCEPTION 'stream % is tombstoned since %', p_stream_ids[i], v_tombstones[i]
                    USING ERRCODE = 'MF410';
            ELSE
                RAISE EXCEPTION 'stream % is at version %, expected %', p_stream_ids[i], v_current[i],
                    p_expected_versions[i] USING ERRCODE = 'MF409', DETAIL = v_current[i]::text;
            END IF;
        END IF;
        v_head := v_heads[i];
        FOR j IN 1 .. p_counts[i] LOOP
            k := k + 1;
            v_index[k] := i;
            v_versions[k] := v_current[i] + j;
            v_take[k] := v_write[i];
            CONTINUE WHEN NOT v_write[i];
            IF p_event_classes[k] = 'observation' THEN
                -- A retry carries the same metadata, so it lands on the same segment and meets
                -- its stored copy at the INSERT's arbiter below.
                v_day := ((p_metadata[k] ->> 'received_at')::timestamptz AT TIME ZONE 'UTC')::date;
                IF v_day IS DISTINCT FROM v_seen_day THEN
                    v_seen_day := v_day;
                    v_day_segment := coalesce((SELECT g.day FROM event_segments g WHERE g.day = v_day),
                                              'infinity');
                END IF;
                v_segments[k] := v_day_segment;
            ELSIF p_event_classes[k] = 'lifecycle' THEN
                v_prevs[k] := v_head;
                v_head := mf_event_hash(v_head, p_stream_ids[i], v_current[i] + j, p_event_ids[k],
                                        p_event_types[k], p_schema_versions[k], p_data[k],
                                        p_metadata[k], v_now);
                v_hashes[k] := v_head;
                v_lifecycles[i] := v_lifecycles[i] + 1;
            END IF;
            IF p_event_types[k] = 'NODE_DECOMMISSIONED' THEN
                v_ends[i] := v_now;
            END IF;
            v_wanted := v_wanted + 1;
        END LOOP;
        v_heads[i] := v_head;
        v_lo := v_hi + 1;
    END LOOP;

    -- Idempotency by event id without a lookup first: an id already stored inserts nothing.
    WITH inserted AS (
        INSERT INTO events (event_id, stream_id, stream_version, event_type, event_class,
                            schema_version, data, metadata, recorded_at, prev_hash, hash,
                            received_at, segment)
        SELECT u.id, p_stream_ids[u.si], u.v, u.t, u.c, u.sv, u.d, u.m, v_now, u.ph, u.h,
               (u.m ->> 'received_at')::timestamptz, u.seg
        FROM unnest(p_event_ids, p_event_types, p_event_classes, p_schema_versions, p_data,
                    p_metadata, v_index, v_versions, v_segments, v_prevs, v_hashes, v_take)
             WITH ORDINALITY AS u(id, t, c, sv, d, m, si, v, seg, ph, h, w, n)
        WHERE u.w
        ORDER BY u.n
        ON CONFLICT (event_id, segment) DO NOTHING
        RETURNING events.global_position, events.stream_version, events.stream_id
    )
    SELECT array_agg(array_position(p_stream_ids, ins.stream_id)), array_agg(ins.global_position),
           array_agg(ins.stream_version)
        INTO v_out_index, v_out_position, v_out_version
        FROM inserted ins;
    v_got := coalesce(array_length(v_out_index, 1), 0);

    IF v_got < v_wanted THEN
        -- Some ids are stored already although their stream was where the caller expected it (a
        -- retry that expected any version, an id taken by another stream): a stream that inserted
        -- nothing was stored whole before and gets what it stored; one that inserted part refuses.
        FOR i IN 1 .. v_streams LOOP
            CONTINUE WHEN NOT v_write[i];
            v_existing := (SELECT count(*) FROM unnest(v_out_index) AS x WHERE x = i);
            IF v_existing = 0 THEN
                v_write[i] := false;
            ELSIF v_existing < p_counts[i] THEN
                RAISE EXCEPTION 'part of this batch is already stored (% of % events)',
                    p_counts[i] - v_existing, p_counts[i] USING ERRCODE = 'MF422';
            END IF;
        END LOOP;
    END IF;

    RETURN QUERY
        SELECT x.si, x.pos, x.ver, false, v_now
        FROM unnest(v_out_index, v_out_position, v_out_version) AS x(si, pos, ver)
        ORDER BY x.si, x.ver;

    v_lo := 1;
    FOR i IN 1 .. v_streams LOOP
        IF NOT v_write[i] THEN
            RETURN QUERY EXECUTE 'SELECT $2, e.global_position, e.stream_version, true, e.recorded_at '
                                 'FROM events e WHERE e.event_id = ANY ($1) ORDER BY e.global_position'
                USING p_event_ids[v_lo:v_lo + p_counts[i] - 1], i;
        END IF;
        v_lo := v_lo + p_counts[i];
    END LOOP;

    INSERT INTO streams AS s (stream_id, version, lifecycle_version, head_hash, tombstoned_at,
                              updated_at)
    SELECT u.id, u.cur + u.cnt, u.lc, u.hh, u.te, v_now
    FROM unnest(p_stream_ids, v_current, p_counts, v_lifecycles, v_heads, v_ends, v_write)
         AS u(id, cur, cnt, lc, hh, te, w)
    WHERE u.w
    ON CONFLICT (stream_id) DO UPDATE
        SET version = EXCLUDED.version, lifecycle_version = EXCLUDED.lifecycle_version,
            head_hash = EXCLUDED.head_hash, tombstoned_at = EXCLUDED.tombstoned_at,
            updated_at = EXCLUDED.updated_at;
END;
$$;

-- The append of a client that kept the streams' folded states (ledger/store.py `_append_kept`),
-- in one round trip instead of two (mf_open_streams, then mf_append_many): the rebuild gate and
-- the streams' locks as mf_open_streams takes them, in the order given; then, under the locks,
-- every stream must be at the version the client kept, with the checkpoint the client kept
-- (`p_projection`'s stored version and position) and no rebuild of that projection since the one
-- it kept them from. Any other: one row with stream index 0 and nothing written, the locks still
-- held, and the client opens the streams as usual in the same transaction. A position is never
-- reused, so a checkpoint at the same version and position is the state the client folded.
CREATE OR REPLACE FUNCTION mf_append_kept(
    p_stream_ids text[], p_expected_versions bigint[], p_counts integer[], p_event_ids uuid[],
    p_event_types text[], p_event_classes text[], p_schema_versions integer[], p_data jsonb[],
    p_metadata jsonb[], p_projection text, p_known_versions bigint[], p_known_positions bigint[],
    p_known_rebuild timestamptz
) RETURNS TABLE (out_stream_index integer, out_global_position bigint, out_stream_version bigint,
               out_already_stored boolean, out_recorded_at timestamptz)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM mf_lock_streams(p_stream_ids);
    IF coalesce((SELECT c.rebuilt_at FROM projection_checkpoints c WHERE c.projection = p_projection),
                '-infinity') IS DISTINCT FROM p_known_rebuild
       OR coalesce(array_length(p_known_versions, 1), 0) <> coalesce(array_length(p_stream_ids, 1), 0)
       OR EXISTS (SELECT 1
                  FROM unnest(p_stream_ids, p_expected_versions, p_known_versions, p_known_positions)
                       AS i(id, ev, kv, kp)
                  LEFT JOIN streams s ON s.stream_id = i.id
                  LEFT JOIN projection_state ps ON ps.projection = p_projection AND ps.stream_id = i.id
                  WHERE i.ev IS DISTINCT FROM i.kv OR s.version IS DISTINCT FROM i.kv
                     OR ps.stream_version IS DISTINCT FROM i.kv OR ps.position IS DISTINCT FROM i.kp) THEN
        RETURN QUERY SELECT 0, NULL::bigint, NULL::bigint, NULL::boolean, NULL::timestamptz;
        RETURN;
    END IF;
    RETURN QUERY
        SELECT a.out_stream_index, a.out_global_position, a.out_stream_version, a.out_already_stored,
               a.out_recorded_at
        FROM mf_append_many(p_stream_ids, p_expected_versions, p_counts, p_event_ids, p_event_types,
                            p_event_classes, p_schema_versions, p_data, p_metadata, true) a;
END;
$$;

-- One stream's append (the database's own callers, and the 0.1 interface): mf_append_many of one.
-- Returns one row per event: (global_position, stream_version, already_stored, recorded_at).
CREATE OR REPLACE FUNCTION mf_append(
    p_stream_id text, p_expected_version bigint, p_event_ids uuid[], p_event_types text[],
    p_event_classes text[], p_schema_versions integer[], p_data jsonb[], p_metadata jsonb[],
    p_locked boolean DEFAULT false
) RETURNS TABLE (out_global_position bigint, out_stream_version bigint, out_already_stored boolean,
               out_recorded_at timestamptz)
LANGUAGE sql AS $$
    SELECT a.out_global_position, a.out_stream_version, a.out_already_stored, a.out_recorded_at
    FROM mf_append_many(ARRAY[p_stream_id], ARRAY[p_expected_version],
                        ARRAY[coalesce(array_length(p_event_ids, 1), 0)], p_event_ids,
                        p_event_types, p_event_classes, p_schema_versions, p_data, p_metadata,
                        p_locked) a
$$;

-- The log's day segments (migration 0004): one partition per UTC day of received observations,
-- created ahead of time so that appends never wait for one. A partition is made as a table of its
-- own and then attached, which locks `events` only against other DDL (SHARE UPDATE EXCLUSIVE),
-- never against appends or reads. Returns the days it created.
CREATE OR REPLACE FUNCTION mf_ensure_segments(p_from date, p_to date)
RETURNS SETOF date
LANGUAGE plpgsql AS $$
DECLARE
    v_day   date;
    v_name  text;
BEGIN
    IF to_regclass('event_segments') IS NULL THEN
        RETURN;  -- before migration 0004: the log is not partitioned yet
    END IF;
    -- Two servers making the same day: the second waits, then finds it made.
    PERFORM pg_advisory_xact_lock(7305820114);
    FOR v_day IN SELECT d::date FROM generate_series(p_from, p_to, interval '1 day') d LOOP
        CONTINUE WHEN EXISTS (SELECT 1 FROM event_segments WHERE day = v_day);
        v_name := 'events_d' || to_char(v_day, 'YYYYMMDD');
        EXECUTE format('CREATE TABLE %I (LIKE events INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                       'INCLUDING COMPRESSION)', v_name);
        EXECUTE format('ALTER TABLE events ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                       v_name, v_day, v_day + 1);
        INSERT INTO event_segments (day, partition) VALUES (v_day, v_name);
        RETURN NEXT v_day;
    END LOOP;
END;
$$;

-- ---------------------------------------------------------------------------------------------
-- Projections (read models). Every table below is derived from the log and rebuilt from it by
-- `modelforge-hw rebuild`; none holds truth of its own.
-- ---------------------------------------------------------------------------------------------

-- Each projection's folded state per stream: its checkpoint (the stream version and global
-- position it has folded up to) and the state the next event is folded onto. The state is the
-- projection's own JSON as bytes (migration 0005): only the projection reads it, and a node's state
-- (about 10 KB) parsed into jsonb on every write and printed back on every read was a third of
-- the database's CPU per agent report.
CREATE TABLE IF NOT EXISTS projection_state (
    projection      text NOT NULL,
    stream_id       text NOT NULL,
    stream_version  bigint NOT NULL,
    position        bigint NOT NULL,
    state           bytea NOT NULL,
    PRIMARY KEY (projection, stream_id)
);
-- The folded state is rewritten on every append; lz4 compresses it several times faster than the
-- default pglz (ignored where the server was built without lz4).
DO $$
BEGIN
    IF mf_has_lz4() AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'projection_state'::regclass
               AND attname = 'state' AND attcompression <> 'l') THEN
        ALTER TABLE projection_state ALTER COLUMN state SET COMPRESSION lz4;
    END IF;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN NULL;
END;
$$;

-- Where each projection was last rebuilt to (a global catch-up checkpoint).
CREATE TABLE IF NOT EXISTS projection_checkpoints (
    projection   text PRIMARY KEY,
    tx_id        xid8 NOT NULL,
    position     bigint NOT NULL,
    rebuilt_at   timestamptz NOT NULL
);

-- The rendered reads' probe (ledger/changes.py): the streams given events by any transaction the
-- previous probe could not see (from its snapshot's xmax on, or in its in-progress list; of the
-- newer ones at most p_limit + 1 events), this statement's snapshot, and when `rebuild` last
-- swapped the read models. A function with a generic plan, planned once per session: as a
-- prepared statement, PostgreSQL's plan cache kept choosing custom plans (the generic plan's
-- estimate assumes a third of the log matches) and so planned the partitioned query again at
-- every probe, 0.6 ms of PostgreSQL CPU per probe against 0.14 (docs/performance.md, issue 12,
-- seventh step). Each condition is its own index scan in every segment: `tx_id >= $1 OR tx_id =
-- ANY($2)` was a sequential scan of the whole log in a generic plan. The in-progress lookup runs
-- only when the previous probe saw transactions in progress (a one-time filter): where the
-- statistics say most of the log shares a few transaction ids (a log written by a bulk import in
-- one transaction) its generic plan reads the whole log (35 ms for 110,000 events at every
-- probe, docs/performance.md, issue 12, eighth step). STABLE: the query runs in the caller's
-- statement snapshot, the one it reports.
CREATE OR REPLACE FUNCTION mf_read_changes(p_after xid8, p_in_progress xid8[], p_limit integer)
RETURNS TABLE (out_xmax xid8, out_in_progress xid8[], out_recent bigint, out_streams text[],
               out_rebuilt_at timestamptz)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN QUERY
        WITH recent AS MATERIALIZED (
            SELECT e.stream_id FROM events e WHERE e.tx_id >= p_after ORDER BY e.tx_id
            LIMIT p_limit + 1
        )
        SELECT pg_snapshot_xmax(s.snap),
               ARRAY(SELECT pg_snapshot_xip(s.snap)),
               (SELECT count(*) FROM recent),
               ARRAY(SELECT DISTINCT u.stream_id
                     FROM (SELECT r.stream_id FROM recent r
                           UNION ALL
                           SELECT e.stream_id FROM events e
                           WHERE cardinality(p_in_progress) > 0 AND e.tx_id = ANY(p_in_progress)) u),
               (SELECT max(c.rebuilt_at) FROM projection_checkpoints c)
        FROM (SELECT pg_current_snapshot() AS snap) s;
END;
$$;

CREATE TABLE IF NOT EXISTS hw_nodes (
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
    lifecycle_version       bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS hw_nodes_identity_idx ON hw_nodes (identity_key);
-- The console lists nodes by hostname, a page at a time (api/console).
CREATE INDEX IF NOT EXISTS hw_nodes_hostname_idx ON hw_nodes ((coalesce(hostname, '')), node_id);

CREATE TABLE IF NOT EXISTS hw_accelerators (
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
    UNIQUE (node_id, uuid)
);
CREATE INDEX IF NOT EXISTS hw_accelerators_status_idx ON hw_accelerators (status, accelerator_id);
-- GPU health verdict (ledger/health.py, docs/gpu-health.md): healthy | degraded | failed; and the
-- XIDs the ledger remembers for the GPU ({code, at}, oldest first): the API and /metrics show them.
DO $$
BEGIN
    IF (SELECT count(*) FROM pg_attribute WHERE attrelid = 'hw_accelerators'::regclass AND NOT attisdropped
        AND attname IN ('health_status', 'health_action', 'health_reasons', 'health_xids')) < 4 THEN
        ALTER TABLE hw_accelerators
            ADD COLUMN IF NOT EXISTS health_status text NOT NULL DEFAULT 'healthy',
            ADD COLUMN IF NOT EXISTS health_action text NOT NULL DEFAULT 'none',
            ADD COLUMN IF NOT EXISTS health_reasons jsonb NOT NULL DEFAULT '[]',
            ADD COLUMN IF NOT EXISTS health_xids jsonb NOT NULL DEFAULT '[]';
    END IF;
END;
$$;
-- `?health=failed` pages a few GPUs out of a large fleet without reading the others.
CREATE INDEX IF NOT EXISTS hw_accelerators_health_idx ON hw_accelerators (health_status, accelerator_id);

CREATE TABLE IF NOT EXISTS hw_node_storage (
    node_id      text NOT NULL,
    mount        text NOT NULL,
    used_bytes   jsonb NOT NULL,
    total_bytes  jsonb NOT NULL,
    PRIMARY KEY (node_id, mount)
);

-- Also the node's liveness: the central receive time of its newest report, and its clock skew.
CREATE TABLE IF NOT EXISTS hw_host_telemetry (
    node_id             text PRIMARY KEY,
    metrics             jsonb NOT NULL,
    observed_at         timestamptz,
    received_at         timestamptz,
    clock_skew_seconds  double precision,
    position            bigint NOT NULL
);

-- Each GPU's newest sample: when it was taken and received, and the event that holds it. The
-- sample itself (metrics and health signals) is read from that event (mf_accelerator_sample):
-- copied into this row, the eight samples of every report were parsed by PostgreSQL a second
-- time and written twice (migration 0006; docs/performance.md, issue 12, eighth step). Retention
-- always keeps each GPU's newest sample (docs/retention.md), so the event is there.
CREATE TABLE IF NOT EXISTS hw_accelerator_telemetry (
    accelerator_id  text PRIMARY KEY,
    node_id         text NOT NULL,
    observed_at     timestamptz,
    received_at     timestamptz,
    position        bigint NOT NULL
);

-- The GPU samples held by the events at `p_positions`, each event read once (a node's snapshot is
-- stored compressed: every read of it decompresses it): of a node's snapshot
-- (NODE_TELEMETRY_OBSERVED) every entry of `accelerators`, the last one where a GPU is listed
-- twice, as the fold takes it; an ACCELERATOR_TELEMETRY_OBSERVED (releases before the snapshot)
-- is its own sample. A sample is `{uuid, telemetry, health, ...}`. One index lookup per event
-- (OFFSET 0: never a join that scans the log).
CREATE OR REPLACE FUNCTION mf_samples(p_positions bigint[])
RETURNS TABLE (out_position bigint, out_uuid text, out_sample jsonb)
LANGUAGE sql STABLE AS $$
    SELECT DISTINCT ON (p.pos, x.value->>'uuid') p.pos, x.value->>'uuid', x.value
    FROM unnest(p_positions) p(pos)
    CROSS JOIN LATERAL (SELECT e.event_type, e.data FROM events e
                        WHERE e.global_position = p.pos OFFSET 0) e
    CROSS JOIN LATERAL jsonb_array_elements(
        CASE WHEN e.event_type = 'ACCELERATOR_TELEMETRY_OBSERVED' THEN jsonb_build_array(e.data)
             ELSE e.data->'accelerators' END) WITH ORDINALITY x(value, n)
    ORDER BY p.pos, x.value->>'uuid', x.n DESC
$$;

-- One GPU's sample from the event at `p_position`: its metrics, and its health signals (null where
-- the agent sent none); of a GPU listed twice in a snapshot the last entry, as in mf_samples. For a
-- query of a GPU at a time (a page of accelerators: its GPUs are of as many nodes); /metrics reads
-- every node's GPUs at once with mf_samples. A path query builds only the matching entry, where
-- expanding the snapshot built all of them.
CREATE OR REPLACE FUNCTION mf_accelerator_sample(p_position bigint, p_uuid text)
RETURNS TABLE (metrics jsonb, health_signals jsonb)
LANGUAGE sql STABLE AS $$
    SELECT x.sample->'telemetry', nullif(x.sample->'health', 'null'::jsonb)
    FROM (SELECT CASE WHEN e.event_type = 'ACCELERATOR_TELEMETRY_OBSERVED' THEN e.data
                      ELSE jsonb_path_query_array(e.data, '$.accelerators[*] ? (@.uuid == $u)',
                                                  jsonb_build_object('u', p_uuid))->-1 END AS sample
          FROM events e WHERE e.global_position = p_position OFFSET 0) x
$$;

CREATE TABLE IF NOT EXISTS hw_fingerprints (
    node_id      text PRIMARY KEY,
    fingerprint  text NOT NULL,
    position     bigint NOT NULL
);

CREATE TABLE IF NOT EXISTS hw_inventory_runs (
    node_id      text PRIMARY KEY,
    outcome      text NOT NULL,
    status       text NOT NULL,
    reasons      jsonb NOT NULL,
    nvml_status  text,
    at           timestamptz,
    position     bigint NOT NULL
);

-- ---------------------------------------------------------------------------------------------
-- Agent plane (issue 4, docs/NODE_AGENT_PROTOCOL.md): enrollment tokens and node credentials are
-- read models like the ones above (derived from lifecycle events by projections/agent.py, rebuilt
-- by `modelforge-hw rebuild`); they hold SHA-256 digests of 256-bit random secrets, never a secret.
-- ---------------------------------------------------------------------------------------------

CREATE TABLE IF NOT EXISTS hw_enrollment_tokens (
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

CREATE TABLE IF NOT EXISTS hw_node_credentials (
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
CREATE INDEX IF NOT EXISTS hw_node_credentials_node_idx ON hw_node_credentials (node_id);

-- Work leases (docs/NODE_DECOMMISSION.md): work that depends on a node, held in the node's stream
-- (WORK_LEASE_ACQUIRED / WORK_LEASE_RELEASED) and shown here while unreleased. An active one (not
-- released, `expires_at` null or in the future) blocks the node's decommission. A read model of
-- the inventory projection, rebuilt like the tables above.
CREATE TABLE IF NOT EXISTS hw_work_leases (
    lease_id     text PRIMARY KEY,
    node_id      text NOT NULL,
    owner        text NOT NULL,
    reason       text NOT NULL,
    acquired_at  timestamptz NOT NULL,
    expires_at   timestamptz,
    actor        text,
    position     bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS hw_work_leases_node_idx ON hw_work_leases (node_id);

-- Write-side, not a read model: the last accepted sequence per (node, agent stream), checked and
-- advanced in the transaction that appends the report's events, under the node's stream lock.
-- Transport state (like a consumer offset): the events carry stream, sequence and body digest in
-- their metadata for audit, but retention prunes old observation events, so a rebuild from the
-- log could move a position backwards and reopen the replay window; `rebuild` never touches it.
-- `recent`: {"<sequence>": "<sha256 of the accepted body>"} for the newest accepted sequences,
-- so an unchanged retry of one of them is answered 200 without appending anything.
CREATE TABLE IF NOT EXISTS agent_stream_positions (
    node_id           text NOT NULL,
    stream            text NOT NULL,
    last_sequence     bigint NOT NULL,
    reports           bigint NOT NULL,
    skipped           bigint NOT NULL,
    recent            jsonb NOT NULL,
    last_observed_at  timestamptz,
    last_received_at  timestamptz NOT NULL,
    PRIMARY KEY (node_id, stream)
);

-- The change feed (ledger/feed.py): wake waiting readers when events commit. One notification per
-- append statement; PostgreSQL delivers it at commit and folds duplicates within a transaction.
-- It only wakes readers: the gap-safe read still decides what they receive.
--
-- Only while some process listens: a transaction that notifies takes a lock shared by the whole
-- cluster at its commit and holds it through its WAL flush, so notifying appenders commit one at a
-- time. With two API servers on one database that halved ingest (docs/performance.md, issue 12,
-- fifth step). A LogFeed that starts listening registers its backend here (and deregisters when it
-- stops); rows of backends that are gone (the pid and start time of a live backend match, so a
-- reused pid does not) count for nothing. A commit that raced a registration wakes its reader at
-- the feed's fallback poll instead.
CREATE TABLE IF NOT EXISTS mf_feed_listeners (
    pid            integer PRIMARY KEY,
    backend_start  timestamptz NOT NULL
);
-- (A development build of this table had `since` instead: its registrations are only ever live
-- ones, so it is simply made again.)
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema()
               AND table_name = 'mf_feed_listeners' AND column_name = 'since') THEN
        DROP TABLE mf_feed_listeners;
        CREATE TABLE mf_feed_listeners (
            pid            integer PRIMARY KEY,
            backend_start  timestamptz NOT NULL
        );
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION mf_notify_log() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM mf_feed_listeners l JOIN pg_stat_activity a
               ON a.pid = l.pid AND a.backend_start = l.backend_start) THEN
        PERFORM pg_notify('mf_log', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER events_notify_log
    AFTER INSERT ON events
    FOR EACH STATEMENT EXECUTE FUNCTION mf_notify_log();

-- ---------------------------------------------------------------------------------------------
-- Storage of the rows every agent report rewrites (docs/performance.md, issue 12, eighth step).
-- * fillfactor 50: a page keeps room for the new versions of its rows, so an update stays on its
--   page (a HOT update: no new index entry, and no lock record for moving the row to another
--   page). With the default 100 the pages are full, and 55 % of the accelerator telemetry
--   updates moved their row: 18.1 against 15.5 KB of WAL per report, measured on a 64-node
--   fleet; of the agents' stream positions, 24 %. The tables are one row per node, accelerator
--   or agent stream, so the cost is tables twice as large (about 20 MB at 10,000 nodes). The
--   setting applies to pages written from now on; `rebuild` writes the tables anew with it.
-- * the folded state stays in its row, compressed: about 9.5 KB of JSON, 2.2 KB compressed, just
--   over the 2 KB at which PostgreSQL moves a value out of line, so every report wrote two TOAST
--   chunks with their index entries and deleted the previous two. toast_tuple_target = 8160
--   makes PostgreSQL compress the row only down to a page instead of 2 KB. (STORAGE MAIN on the
--   column does not: PostgreSQL then first moves the row's other values, the stream id, out of
--   line.)
-- ---------------------------------------------------------------------------------------------
-- Altered only where not yet so: an ALTER takes its table's lock even when it changes nothing, and
-- this file runs at every server start, beside servers already writing.
DO $$
DECLARE
    v_table  text;
    v_want   text[];
BEGIN
    FOREACH v_table IN ARRAY ARRAY['projection_state', 'hw_accelerator_telemetry', 'hw_host_telemetry',
                                   'hw_node_storage', 'hw_inventory_runs', 'hw_nodes', 'agent_stream_positions'] LOOP
        v_want := CASE WHEN v_table = 'projection_state'
                       THEN ARRAY['fillfactor=50', 'toast_tuple_target=8160']
                       ELSE ARRAY['fillfactor=50'] END;
        IF NOT coalesce((SELECT reloptions @> v_want FROM pg_class WHERE oid = v_table::regclass), false)
        THEN
            EXECUTE format('ALTER TABLE %I SET (%s)', v_table, array_to_string(v_want, ', '));
        END IF;
    END LOOP;
END;
$$;

INSERT INTO schema_version (version) VALUES (1) ON CONFLICT (version) DO NOTHING;
