-- What every writer of streams takes first, for the rest of its transaction: the rebuild gate,
-- shared (`rebuild` holds it exclusively for its swap), then each stream's advisory lock in the
-- order given. Callers sort the ids: one lock order for everyone, so no two batches deadlock.
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
