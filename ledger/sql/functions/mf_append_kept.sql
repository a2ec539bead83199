-- The append of a client that kept the streams' folded states (ledger/store.py `_append_kept`),
-- in one round trip instead of two (mf_open_streams, then mf_append_many): the streams' locks as
-- mf_open_streams takes them, in the order given; then, under the locks, the kept states must be
-- the stored ones (mf_kept_current). Else: one row with stream index 0 and nothing written, the
-- locks still held, and the client opens the streams as usual in the same transaction.
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
    IF NOT mf_kept_current(p_stream_ids, p_expected_versions, p_projection, p_known_versions,
                           p_known_positions, p_known_rebuild) THEN
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
