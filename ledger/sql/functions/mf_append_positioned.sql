-- Append events to streams: one round trip for one stream or a group commit's batch of them
-- (mf_append_many and mf_append_kept call it). `p_positions[k]`, where not NULL, is the global
-- position event k takes, one the writer reserved from the log's own sequence
-- (`events_global_position_seq`) to fold its events before it sends them (mf_append_folded);
-- NULL: the next of that sequence, as the identity would take it. `p_counts[i]` events of the flat arrays go to `p_stream_ids[i]` (each id once) at
-- `p_expected_versions[i]` (NULL: any version). Per stream:
--   * the streams' locks (mf_lock_streams): appends to different streams run in parallel, and
--     `rebuild` can briefly hold every writer at its swap; `p_locked` says the caller took them
--     already (a group commit, in sorted order);
--   * optimistic concurrency: a stale expected version raises SQLSTATE MF409, writes nothing;
--   * idempotency by event_id: a stream's batch already stored whole returns its positions
--     (already_stored) and writes nothing; part of it stored raises MF422;
--   * a tombstoned stream takes no event (SQLSTATE MF410); NODE_DECOMMISSIONED tombstones it;
--   * lifecycle events are hash-chained per stream (mf_event_hash);
--   * an observation goes to the segment of the UTC day it was received (`p_received[k]`, the
--     metadata's received_at), if that day has one;
--   * an event is stored as jsonb (`p_data[k]`, `p_metadata[k]`) or, an observation only, as a
--     compact body (`p_bodies[k]`, ledger/compact.py; its data and metadata NULL), with
--     `p_sampled[k]`, the digest of the GPUs a snapshot samples (retention compares it; a body
--     of format 3 or 4 names its stored GPU set by it, MF424 where that set is not stored).
-- Any refusal fails the whole call (and the caller's transaction).
--
-- The streams that take their events are written set-wise: one INSERT of all their events, one
-- upsert of their streams, one segment lookup per day, one recorded_at for the call. Stream by
-- stream, a batch would cost a function call, a streams read, an INSERT with its statement
-- trigger and a streams upsert per stream (docs/performance.md).
-- Rows: (stream index, 1-based; global_position; stream_version; already_stored; recorded_at).
--
-- Statements with fixed shapes keep cached plans; the lookups of already-stored events run only
-- for a retry, a conflict or a tombstone, by EXECUTE, so each is planned for the log as it is
-- then (a generic plan cached while the log was small would keep scanning it whole as it grows).
CREATE OR REPLACE FUNCTION mf_append_positioned(
    p_stream_ids text[], p_expected_versions bigint[], p_counts integer[], p_event_ids uuid[],
    p_event_types text[], p_event_classes text[], p_schema_versions integer[], p_data jsonb[],
    p_metadata jsonb[], p_bodies bytea[], p_received timestamptz[], p_sampled uuid[],
    p_locked boolean, p_positions bigint[]
) RETURNS TABLE (out_stream_index integer, out_global_position bigint, out_stream_version bigint,
               out_already_stored boolean, out_recorded_at timestamptz)
LANGUAGE plpgsql
-- Planned once, for index probes: its statements touch a few rows by key (pages in memory), and
-- with the default random_page_cost the planner hashed a scan of `streams` in a fleet of a few
-- hundred nodes, or planned a statement anew on every call (each batch's own plan, its arrays'
-- lengths known, costing less than the generic one): more CPU than running it.
SET plan_cache_mode = force_generic_plan
SET random_page_cost = 1.1
AS $$
DECLARE
    v_streams      integer := coalesce(array_length(p_stream_ids, 1), 0);
    v_n            integer := coalesce(array_length(p_event_ids, 1), 0);
    v_current      bigint[];
    v_lifecycles   bigint[];
    v_heads        bytea[];
    v_tombstones   timestamptz[];
    v_exists       boolean[];     -- per stream: it has a row in `streams`
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
    v_misshapen    boolean;
    v_set_missing  boolean;
BEGIN
    IF v_streams = 0 THEN
        RETURN;
    END IF;
    -- The arguments' shape, and (in the same statement: one query instead of two) whether a
    -- snapshot of format 3 or 4 (a body's second byte) names a GPU set that is not stored: it
    -- lists its GPUs by their index in the set its `sampled` names, and would be unreadable (MF424:
    -- the writer remembered a set whose commit a failover lost; it stores it again,
    -- ledger/gpu_sets.py).
    SELECT coalesce(array_length(p_expected_versions, 1), 0) <> v_streams
           OR coalesce(array_length(p_counts, 1), 0) <> v_streams
           OR (SELECT sum(c) <> v_n OR min(c) < 1 FROM unnest(p_counts) AS c)
           OR (SELECT count(DISTINCT x) FROM unnest(p_stream_ids) AS x) <> v_streams
           OR coalesce(array_length(p_bodies, 1), 0) <> v_n
           OR coalesce(array_length(p_received, 1), 0) <> v_n
           OR coalesce(array_length(p_sampled, 1), 0) <> v_n
           OR (p_positions IS NOT NULL AND coalesce(array_length(p_positions, 1), 0) <> v_n),
           EXISTS (SELECT 1 FROM unnest(p_bodies, p_sampled) AS b(body, sampled)
                   WHERE get_byte(b.body, 1) IN (3, 4)
                     AND NOT EXISTS (SELECT 1 FROM gpu_sets g WHERE g.sampled = b.sampled))
        INTO v_misshapen, v_set_missing;
    IF v_misshapen IS NOT FALSE THEN
        RAISE EXCEPTION 'an append names each stream once, with one count of at least 1 per stream '
                        'and as many events as the counts add up to' USING ERRCODE = '22023';
    END IF;
    IF v_set_missing THEN
        RAISE EXCEPTION 'a snapshot of format 3 or 4 names a GPU set that is not stored'
            USING ERRCODE = 'MF424';
    END IF;
    IF NOT p_locked THEN
        PERFORM mf_lock_streams(p_stream_ids);
    END IF;
    -- Taken once the locks are held, so a stream's recorded_at never goes back.
    v_now := clock_timestamp();

    SELECT array_agg(coalesce(s.version, 0) ORDER BY u.n),
           array_agg(coalesce(s.lifecycle_version, 0) ORDER BY u.n),
           array_agg(s.head_hash ORDER BY u.n),
           array_agg(s.tombstoned_at ORDER BY u.n),
           array_agg(s.stream_id IS NOT NULL ORDER BY u.n)
        INTO v_current, v_lifecycles, v_heads, v_tombstones, v_exists
        FROM unnest(p_stream_ids) WITH ORDINALITY AS u(id, n)
        -- Each stream's row by its key (LIMIT keeps the subquery from being joined as a table:
        -- the generic plan of the join hashes a scan of `streams` in a fleet of a few hundred).
        LEFT JOIN LATERAL (SELECT s.version, s.lifecycle_version, s.head_hash, s.tombstoned_at, s.stream_id
                           FROM streams s WHERE s.stream_id = u.id LIMIT 1) s ON true;

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
                v_day := (p_received[k] AT TIME ZONE 'UTC')::date;
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
        INSERT INTO events (global_position, event_id, stream_id, stream_version, event_type,
                            event_class, schema_version, data, metadata, recorded_at, prev_hash,
                            hash, received_at, segment, body, sampled)
        OVERRIDING SYSTEM VALUE
        -- The identity's own sequence where no position is given; evaluated after the sort, in
        -- the events' order.
        SELECT coalesce(u.pos, nextval('events_global_position_seq'::regclass)), u.id,
               p_stream_ids[u.si], u.v, u.t, u.c, u.sv, u.d, u.m, v_now, u.ph, u.h, u.r, u.seg,
               u.b, u.sd
        FROM unnest(p_event_ids, p_event_types, p_event_classes, p_schema_versions, p_data,
                    p_metadata, v_index, v_versions, v_segments, v_prevs, v_hashes, v_take,
                    p_bodies, p_received, p_sampled, p_positions)
             WITH ORDINALITY AS u(id, t, c, sv, d, m, si, v, seg, ph, h, w, b, r, sd, pos, n)
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

    -- A stream already stored is updated in place; an upsert would lock its row first, a WAL
    -- record per stream that a plain UPDATE does not write. New streams (their first append,
    -- under the same lock) are inserted.
    UPDATE streams s
    SET version = u.cur + u.cnt, lifecycle_version = u.lc, head_hash = u.hh, tombstoned_at = u.te,
        updated_at = v_now
    FROM unnest(p_stream_ids, v_current, p_counts, v_lifecycles, v_heads, v_ends, v_write, v_exists)
         AS u(id, cur, cnt, lc, hh, te, w, ex)
    WHERE u.w AND u.ex AND s.stream_id = u.id;
    IF NOT (true = ALL (v_exists)) THEN
        INSERT INTO streams AS s (stream_id, version, lifecycle_version, head_hash, tombstoned_at,
                                  updated_at)
        SELECT u.id, u.cur + u.cnt, u.lc, u.hh, u.te, v_now
        FROM unnest(p_stream_ids, v_current, p_counts, v_lifecycles, v_heads, v_ends, v_write, v_exists)
             AS u(id, cur, cnt, lc, hh, te, w, ex)
        WHERE u.w AND NOT u.ex
        ON CONFLICT (stream_id) DO UPDATE
            SET version = EXCLUDED.version, lifecycle_version = EXCLUDED.lifecycle_version,
                head_hash = EXCLUDED.head_hash, tombstoned_at = EXCLUDED.tombstoned_at,
                updated_at = EXCLUDED.updated_at;
    END IF;
END;
$$;
