-- The append of a writer that folded its events before sending them (ledger/folded_append.py):
-- mf_append_kept's locks and checks of the kept states, with the global positions the writer
-- reserved from the log's sequence (`events_global_position_seq`) and folded into those states,
-- so that the read models' rows, the checkpoints and whatever else the writer adds are written by
-- the same statement, outside a transaction block: one round trip for the batch, commit included.
-- Any check that fails raises SQLSTATE MF412 and the statement writes nothing: a stream not at the
-- version and checkpoint kept, a rebuild since, an event already stored (the writer folded it as
-- new), or positions that are not each stream's next in order (every one above the stream's kept
-- position, ascending, none past what the sequence has handed out: a stream's events keep their
-- positions in the order of their versions, whichever writer reserved them). The writer then
-- appends the usual way, in a transaction, on what it reads there.
CREATE OR REPLACE FUNCTION mf_append_folded(
    p_stream_ids text[], p_expected_versions bigint[], p_counts integer[], p_event_ids uuid[],
    p_event_types text[], p_event_classes text[], p_schema_versions integer[], p_data jsonb[],
    p_metadata jsonb[], p_bodies bytea[], p_received timestamptz[], p_sampled uuid[],
    p_positions bigint[], p_projection text, p_known_versions bigint[], p_known_positions bigint[],
    p_known_rebuild timestamptz
) RETURNS TABLE (out_stream_index integer, out_global_position bigint, out_stream_version bigint,
               out_already_stored boolean, out_recorded_at timestamptz)
LANGUAGE plpgsql
-- Planned once, for index probes (mf_append_kept says why).
SET plan_cache_mode = force_generic_plan
SET random_page_cost = 1.1
AS $$
DECLARE
    r      record;
    v_lo   integer := 1;
    v_last bigint;
    i      integer;
    k      integer;
BEGIN
    PERFORM mf_lock_streams(p_stream_ids);
    -- mf_append_kept's check of the kept states, written out again: a function of its own costs
    -- a call (about 80 us of the backend's CPU per batch) for a check that costs 110.
    IF coalesce((SELECT c.rebuilt_at FROM projection_checkpoints c WHERE c.projection = p_projection),
                '-infinity') IS DISTINCT FROM p_known_rebuild
       OR coalesce(array_length(p_known_versions, 1), 0) <> coalesce(array_length(p_stream_ids, 1), 0)
       OR coalesce(array_length(p_positions, 1), 0) <> coalesce(array_length(p_event_ids, 1), 0)
       OR EXISTS (SELECT 1
                  FROM unnest(p_stream_ids, p_expected_versions, p_known_versions, p_known_positions)
                       AS i(id, ev, kv, kp)
                  LEFT JOIN LATERAL (SELECT s.version FROM streams s WHERE s.stream_id = i.id LIMIT 1) s
                      ON true
                  LEFT JOIN LATERAL (SELECT ps.stream_version, ps.position FROM projection_state ps
                                     WHERE ps.projection = p_projection AND ps.stream_id = i.id LIMIT 1) ps
                      ON true
                  WHERE i.ev IS DISTINCT FROM i.kv OR s.version IS DISTINCT FROM i.kv
                     OR ps.stream_version IS DISTINCT FROM i.kv OR ps.position IS DISTINCT FROM i.kp)
       OR (SELECT max(pos) FROM unnest(p_positions) AS pos)
          > (SELECT q.last_value FROM events_global_position_seq q) THEN
        RAISE EXCEPTION 'the kept states or the reserved positions are not current'
            USING ERRCODE = 'MF412';
    END IF;
    -- Each event's position above the one before it in its stream, the first above the stream's
    -- kept position.
    FOR i IN 1 .. coalesce(array_length(p_stream_ids, 1), 0) LOOP
        v_last := p_known_positions[i];
        FOR k IN v_lo .. v_lo + p_counts[i] - 1 LOOP
            IF p_positions[k] IS NULL OR p_positions[k] <= v_last THEN
                RAISE EXCEPTION 'the reserved positions are not each stream''s next'
                    USING ERRCODE = 'MF412';
            END IF;
            v_last := p_positions[k];
        END LOOP;
        v_lo := v_lo + p_counts[i];
    END LOOP;
    FOR r IN
        SELECT a.out_stream_index, a.out_global_position, a.out_stream_version, a.out_already_stored,
               a.out_recorded_at
        FROM mf_append_positioned(p_stream_ids, p_expected_versions, p_counts, p_event_ids,
                                  p_event_types, p_event_classes, p_schema_versions, p_data,
                                  p_metadata, p_bodies, p_received, p_sampled, true, p_positions) a
    LOOP
        IF r.out_already_stored THEN
            RAISE EXCEPTION 'events of this batch are already stored' USING ERRCODE = 'MF412';
        END IF;
        out_stream_index := r.out_stream_index;
        out_global_position := r.out_global_position;
        out_stream_version := r.out_stream_version;
        out_already_stored := false;
        out_recorded_at := r.out_recorded_at;
        RETURN NEXT;
    END LOOP;
END;
$$;
