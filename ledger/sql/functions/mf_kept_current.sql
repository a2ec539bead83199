-- Whether a writer's kept states are the stored ones, under the streams' locks (the caller took
-- them): every stream at the version the writer kept (`p_expected_versions` naming that version
-- too), its checkpoint of `p_projection` at that version and position, and no rebuild of that
-- projection since the one the states were kept from. A position is never reused, so a
-- checkpoint at the same version and position is the state the writer folded. mf_append_kept
-- and mf_append_folded decide on it.
CREATE OR REPLACE FUNCTION mf_kept_current(
    p_stream_ids text[], p_expected_versions bigint[], p_projection text, p_known_versions bigint[],
    p_known_positions bigint[], p_known_rebuild timestamptz
) RETURNS boolean
LANGUAGE plpgsql
-- Planned once, for index probes: its statements touch a few rows by key (pages in memory), and
-- with the default random_page_cost the planner hashed a scan of `streams` in a fleet of a few
-- hundred nodes, or planned a statement anew on every call.
SET plan_cache_mode = force_generic_plan
SET random_page_cost = 1.1
AS $$
BEGIN
    RETURN NOT (
        coalesce((SELECT c.rebuilt_at FROM projection_checkpoints c WHERE c.projection = p_projection),
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
                      OR ps.stream_version IS DISTINCT FROM i.kv OR ps.position IS DISTINCT FROM i.kp));
END;
$$;
