-- The GPU samples held by the events at `p_positions`, each event read once (a node's snapshot is
-- stored compressed: every read of it decompresses it): of a node's snapshot
-- (NODE_TELEMETRY_OBSERVED) every entry of `accelerators`, the last one where a GPU is listed
-- twice, as the fold takes it; an ACCELERATOR_TELEMETRY_OBSERVED (written by releases before the
-- snapshot event) is its own sample. A sample is `{uuid, telemetry, health, ...}`. One index
-- lookup per event (OFFSET 0: never a join that scans the log). /metrics reads every node's GPUs
-- at once with it.
CREATE OR REPLACE FUNCTION mf_samples(p_positions bigint[])
RETURNS TABLE (out_position bigint, out_uuid text, out_sample jsonb)
LANGUAGE sql STABLE AS $$
    SELECT DISTINCT ON (p.pos, x.value->>'uuid') p.pos, x.value->>'uuid', x.value
    FROM unnest(p_positions) p(pos)
    CROSS JOIN LATERAL (SELECT e.event_type, e.data FROM events e
                        WHERE e.global_position = p.pos OFFSET 0) e
    CROSS JOIN LATERAL jsonb_array_elements(
        CASE WHEN e.event_type = 'ACCELERATOR_TELEMETRY_OBSERVED' THEN jsonb_build_array(e.data)
             ELSE e.data->'accelerators' END) WITH ORDINALITY x(value, n)
    ORDER BY p.pos, x.value->>'uuid', x.n DESC
$$;
