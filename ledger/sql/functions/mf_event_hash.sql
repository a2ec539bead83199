-- The canonical bytes of an event, hashed into its stream's chain: sha256(prev_hash || bytes).
-- jsonb's text form is deterministic for a given value, so the hash can be recomputed from the
-- stored row alone (ledger/verify.py).
--
-- STABLE, as its body is (concat_ws is STABLE): PostgreSQL inlines a SQL function into its
-- caller's plan only when the declared volatility is no stricter than the body's. Inlined, an
-- append's cached plan holds the expression itself instead of parsing and planning this body in
-- every transaction that appends a lifecycle event (tests/test_ledger.py checks the plan).
CREATE OR REPLACE FUNCTION mf_event_hash(
    p_prev_hash bytea, p_stream_id text, p_stream_version bigint, p_event_id uuid,
    p_event_type text, p_schema_version integer, p_data jsonb, p_metadata jsonb,
    p_recorded_at timestamptz
) RETURNS bytea
LANGUAGE sql STABLE AS $$
    SELECT sha256(
        coalesce(p_prev_hash, ''::bytea) ||
        convert_to(
            concat_ws(E'\x1f', p_stream_id, p_stream_version::text, p_event_id::text, p_event_type,
                      p_schema_version::text, p_data::text, p_metadata::text,
                      (extract(epoch FROM p_recorded_at) * 1000000)::bigint::text),
            'UTF8'))
$$;
