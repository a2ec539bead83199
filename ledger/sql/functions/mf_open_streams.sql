-- Open streams for a unit of work (one stream) or a batch of them (group commit): the streams'
-- locks (mf_lock_streams), then where each stream stands and the folded state projection
-- `p_projection` checkpointed for it, one row per id in the order given, all in one round trip.
-- A function, so the rows are read with a snapshot taken after the locks are granted (a single
-- SELECT would read with the snapshot of its start, before a wait for a lock).
--
-- The client may already hold some of the folded states (ledger/state_cache.py keeps the states
-- it wrote): for each stream it names the checkpoint it holds, (stream version, position), and
-- the projection's rebuild it holds them from (projection_checkpoints.rebuilt_at; -infinity
-- before any). A checkpoint that is still the one stored comes back without its state (out_state
-- NULL, out_state_version set): a node's state is about 10 KB that PostgreSQL would decompress
-- and send and the client decode, on every report. A position is never reused (the log's
-- sequence), so a stream's checkpoint at the same version and position is the same fold of the
-- same events; a rebuild writes every state anew, and its new rebuilt_at sends them all again.
CREATE OR REPLACE FUNCTION mf_open_streams(p_stream_ids text[], p_projection text,
                                           p_known_versions bigint[], p_known_positions bigint[],
                                           p_known_rebuild timestamptz)
RETURNS TABLE (out_stream_id text, out_version bigint, out_lifecycle_version bigint,
               out_tombstoned_at timestamptz, out_state bytea, out_state_version bigint,
               out_state_position bigint, out_rebuild timestamptz)
LANGUAGE plpgsql
-- Planned once, for index probes: its statements touch a few rows by key (pages in memory), and
-- with the default random_page_cost the planner hashed a scan of `streams` in a fleet of a few
-- hundred nodes, or planned a statement anew on every call (each batch's own plan, its arrays'
-- lengths known, costing less than the generic one): more CPU than running it.
SET plan_cache_mode = force_generic_plan
SET random_page_cost = 1.1
AS $$
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
        -- Each stream's row and checkpoint by its key (LIMIT keeps the subqueries from being
        -- joined as tables: the generic plan of the join hashes a scan of both in a fleet of a
        -- few hundred nodes).
        LEFT JOIN LATERAL (SELECT s.version, s.lifecycle_version, s.tombstoned_at FROM streams s
                           WHERE s.stream_id = i.id LIMIT 1) s ON true
        LEFT JOIN LATERAL (SELECT ps.state, ps.stream_version, ps.position FROM projection_state ps
                           WHERE ps.projection = p_projection AND ps.stream_id = i.id LIMIT 1) ps ON true
        ORDER BY i.n;
END;
$$;

-- The two-argument form sends every state: for callers that keep none (`EventStore.open_streams`),
-- and for servers of an older release running beside a newer one in a rolling upgrade
-- (docs/upgrades.md).
CREATE OR REPLACE FUNCTION mf_open_streams(p_stream_ids text[], p_projection text)
RETURNS TABLE (out_stream_id text, out_version bigint, out_lifecycle_version bigint,
               out_tombstoned_at timestamptz, out_state bytea)
LANGUAGE sql AS $$
    SELECT o.out_stream_id, o.out_version, o.out_lifecycle_version, o.out_tombstoned_at, o.out_state
    FROM mf_open_streams(p_stream_ids, p_projection, NULL, NULL, NULL) o
$$;
