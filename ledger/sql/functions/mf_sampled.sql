-- The digest of the GPUs a node's telemetry snapshot samples: an md5, as a uuid, of their GPU
-- UUIDs, distinct, in byte order, joined by ','. A compact snapshot carries it (`sampled`, written
-- by the appender: ledger/compact.py `sampled_digest` computes the same); of a jsonb snapshot it is
-- computed from `data`. Retention lets a newer snapshot supersede an older one only where the
-- two sample the same GPUs, so each GPU's newest sample stays.
CREATE OR REPLACE FUNCTION mf_sampled(p_data jsonb, p_sampled uuid) RETURNS uuid
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(p_sampled, (
        SELECT md5(coalesce(string_agg(u, ',' ORDER BY u COLLATE "C"), ''))::uuid
        FROM (SELECT DISTINCT a ->> 'uuid' AS u
              FROM jsonb_array_elements(coalesce(p_data -> 'accelerators', '[]')) a) x))
$$;
