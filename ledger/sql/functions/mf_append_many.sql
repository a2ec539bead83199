-- Append events to streams, each event at the next global position of the log's sequence:
-- mf_append_positioned without positions given (its comment says what an append checks and writes).
-- Rows: (stream index, 1-based; global_position; stream_version; already_stored; recorded_at).
CREATE OR REPLACE FUNCTION mf_append_many(
    p_stream_ids text[], p_expected_versions bigint[], p_counts integer[], p_event_ids uuid[],
    p_event_types text[], p_event_classes text[], p_schema_versions integer[], p_data jsonb[],
    p_metadata jsonb[], p_bodies bytea[], p_received timestamptz[], p_sampled uuid[],
    p_locked boolean DEFAULT false
) RETURNS TABLE (out_stream_index integer, out_global_position bigint, out_stream_version bigint,
               out_already_stored boolean, out_recorded_at timestamptz)
LANGUAGE plpgsql
AS $$
BEGIN
    RETURN QUERY
        SELECT a.out_stream_index, a.out_global_position, a.out_stream_version, a.out_already_stored,
               a.out_recorded_at
        FROM mf_append_positioned(p_stream_ids, p_expected_versions, p_counts, p_event_ids,
                                  p_event_types, p_event_classes, p_schema_versions, p_data,
                                  p_metadata, p_bodies, p_received, p_sampled, p_locked, NULL) a;
END;
$$;
