-- 0.3: lock a stream and read its folded state in one round trip. A unit of work paid one round
-- trip for the lock (mf_lock_stream) and another for the owning projection's checkpoint; every
-- report and refresh pays this. A function, like mf_lock_stream, so the stream row and the state
-- are read with a snapshot taken after the lock is granted (a plain SELECT would read with the
-- snapshot of its start, before a wait for the lock).
CREATE OR REPLACE FUNCTION mf_open_stream(p_stream_id text, p_projection text)
RETURNS TABLE (out_version bigint, out_lifecycle_version bigint, out_tombstoned_at timestamptz,
               out_state text)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(7305820111);  -- the rebuild gate
    PERFORM pg_advisory_xact_lock(hashtextextended(p_stream_id, 0));
    RETURN QUERY
        SELECT coalesce(max(s.version), 0), coalesce(max(s.lifecycle_version), 0), max(s.tombstoned_at),
               (SELECT ps.state::text FROM projection_state ps
                WHERE ps.projection = p_projection AND ps.stream_id = p_stream_id)
        FROM streams s WHERE s.stream_id = p_stream_id;
END;
$$;
