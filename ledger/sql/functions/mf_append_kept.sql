-- The append of a client that kept the streams' folded states (ledger/store.py `_append_kept`),
-- in one round trip instead of two (mf_open_streams, then mf_append_many): the streams' locks as
-- mf_open_streams takes them, in the order given; then, under the locks, every stream must be at
-- the version the client kept, with the checkpoint the client kept (`p_projection`'s stored
-- version and position) and no rebuild of that projection since the one it kept them from. Any
-- other: one row with stream index 0 and nothing written, the locks still held, and the client
-- opens the streams as usual in the same transaction. A position is never reused, so a
-- checkpoint at the same version and position is the state the client folded.
CREATE OR REPLACE FUNCTION mf_append_kept(
    p_stream_ids text[], p_expected_versions bigint[], p_counts integer[], p_event_ids uuid[],
    p_event_types text[], p_event_classes text[], p_schema_versions integer[], p_data jsonb[],
    p_metadata jsonb[], p_bodies bytea[], p_received timestamptz[], p_sampled uuid[],
    p_projection text, p_known_versions bigint[], p_known_positions bigint[],
    p_known_rebuild timestamptz
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
BEGIN
    PERFORM mf_lock_streams(p_stream_ids);
    IF coalesce((SELECT c.rebuilt_at FROM projection_checkpoints c WHERE c.projection = p_projection),
                '-infinity') IS DISTINCT FROM p_known_rebuild
       OR coalesce(array_length(p_known_versions, 1), 0) <> coalesce(array_length(p_stream_ids, 1), 0)
       OR EXISTS (SELECT 1
                  FROM unnest(p_stream_ids, p_expected_versions, p_known_versions, p_known_positions)
                       AS i(id, ev, kv, kp)
                  -- Each stream's row and checkpoint by its key (LIMIT keeps the subqueries from
                  -- being joined as tables: the generic plan of the join hashes a scan of both in
                  -- a fleet of a few hundred nodes).
                  LEFT JOIN LATERAL (SELECT s.version FROM streams s WHERE s.stream_id = i.id LIMIT 1) s
                      ON true
                  LEFT JOIN LATERAL (SELECT ps.stream_version, ps.position FROM projection_state ps
                                     WHERE ps.projection = p_projection AND ps.stream_id = i.id LIMIT 1) ps
                      ON true
                  WHERE i.ev IS DISTINCT FROM i.kv OR s.version IS DISTINCT FROM i.kv
                     OR ps.stream_version IS DISTINCT FROM i.kv OR ps.position IS DISTINCT FROM i.kp) THEN
        RETURN QUERY SELECT 0, NULL::bigint, NULL::bigint, NULL::boolean, NULL::timestamptz;
        RETURN;
    END IF;
    RETURN QUERY
        SELECT a.out_stream_index, a.out_global_position, a.out_stream_version, a.out_already_stored,
               a.out_recorded_at
        FROM mf_append_positioned(p_stream_ids, p_expected_versions, p_counts, p_event_ids,
                                  p_event_types, p_event_classes, p_schema_versions, p_data,
                                  p_metadata, p_bodies, p_received, p_sampled, true, NULL) a;
END;
$$;
