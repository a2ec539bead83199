-- Advance agent streams' positions a group commit's batch decided on kept copies of
-- (api/services/reports.py `_commit_kept`): each row only where it is still the version the copy
-- was taken from (`xmin`, the transaction that wrote it), so a row another transaction wrote since
-- is left alone and missing from the rows returned (node id, stream, the new row's `xmin`). A
-- function for its generic plan: as a prepared statement, each batch's own plan (its arrays'
-- lengths known) costs less than the generic one, and PostgreSQL planned it anew on every call,
-- more CPU than running it. PL/pgSQL, whose plans a session keeps (PostgreSQL 15 plans an SQL
-- function's body on every call).
CREATE OR REPLACE FUNCTION mf_advance_positions(
    p_node_ids text[], p_streams text[], p_sequences bigint[], p_skipped bigint[], p_recent bytea[],
    p_observed timestamptz[], p_received timestamptz[], p_written bigint[]
) RETURNS TABLE (out_node_id text, out_stream text, out_written bigint)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET random_page_cost = 1.1
AS $$
BEGIN
    RETURN QUERY UPDATE agent_stream_positions AS p SET
        last_sequence = u.last_sequence, reports = p.reports + 1, skipped = p.skipped + u.skipped,
        recent = u.recent, last_observed_at = u.observed_at, last_received_at = u.received_at
    FROM unnest(p_node_ids, p_streams, p_sequences, p_skipped, p_recent, p_observed, p_received,
                p_written)
         AS u(node_id, stream, last_sequence, skipped, recent, observed_at, received_at, written)
    WHERE p.node_id = u.node_id AND p.stream = u.stream AND p.xmin::text::bigint = u.written
    RETURNING p.node_id, p.stream, p.xmin::text::bigint;
END;
$$;
