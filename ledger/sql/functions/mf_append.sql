-- One stream's append: mf_append_many of one stream. The first release's servers call it (beside
-- a newer one in a rolling upgrade), and it is the short way to append from SQL by hand. One row
-- per event: (global_position, stream_version, already_stored, recorded_at). It stores jsonb only.
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
                        array_fill(NULL::bytea, ARRAY[coalesce(array_length(p_event_ids, 1), 0)]),
                        ARRAY(SELECT (m ->> 'received_at')::timestamptz FROM unnest(p_metadata) m),
                        array_fill(NULL::uuid, ARRAY[coalesce(array_length(p_event_ids, 1), 0)]),
                        p_locked) a
$$;
