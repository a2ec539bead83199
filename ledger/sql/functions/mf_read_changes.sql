-- The rendered reads' probe (ledger/changes.py): the streams given events by any transaction the
-- previous probe could not see (from its snapshot's xmax on, or in its in-progress list; of the
-- newer ones at most p_limit + 1 events), this statement's snapshot, and when `rebuild` last
-- swapped the read models.
--
-- A function with a generic plan, planned once per session: as a prepared statement,
-- PostgreSQL's plan cache keeps choosing custom plans (the generic plan's estimate assumes a
-- third of the log matches) and so plans the partitioned query again at every probe. Each
-- condition is its own index scan in every segment: `tx_id >= $1 OR tx_id = ANY($2)` is a
-- sequential scan of the whole log in a generic plan. The in-progress lookup runs only when the
-- previous probe saw transactions in progress (a one-time filter): where the statistics say most
-- of the log shares a few transaction ids (a log written by a bulk import in one transaction),
-- its generic plan reads the whole log (docs/performance.md). STABLE: the query runs in the
-- caller's statement snapshot, the one it reports.
CREATE OR REPLACE FUNCTION mf_read_changes(p_after xid8, p_in_progress xid8[], p_limit integer)
RETURNS TABLE (out_xmax xid8, out_in_progress xid8[], out_recent bigint, out_streams text[],
               out_rebuilt_at timestamptz)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN QUERY
        WITH recent AS MATERIALIZED (
            SELECT e.stream_id FROM events e WHERE e.tx_id >= p_after ORDER BY e.tx_id
            LIMIT p_limit + 1
        )
        SELECT pg_snapshot_xmax(s.snap),
               ARRAY(SELECT pg_snapshot_xip(s.snap)),
               (SELECT count(*) FROM recent),
               ARRAY(SELECT DISTINCT u.stream_id
                     FROM (SELECT r.stream_id FROM recent r
                           UNION ALL
                           SELECT e.stream_id FROM events e
                           WHERE cardinality(p_in_progress) > 0 AND e.tx_id = ANY(p_in_progress)) u),
               (SELECT max(c.rebuilt_at) FROM projection_checkpoints c)
        FROM (SELECT pg_current_snapshot() AS snap) s;
END;
$$;
