-- Version 10: what every agent report rewrites, smaller. The folded states are written already
-- compressed (msgpack, deflated, behind a format byte; projections/framework.py), so PostgreSQL
-- stores them as they come instead of trying to compress them again. A checkpoint written as JSON
-- before stays as it is and still decodes; it is written in the new encoding with its next event.
ALTER TABLE projection_state ALTER COLUMN state SET STORAGE EXTERNAL;

-- A stream's recent digests as bytes, per sequence its number (8 bytes, big-endian) and the 32
-- bytes of the digest: a full window stays in the row (api/services/positions.py), where its JSON
-- went to TOAST and was written anew there with every report. The conversion keeps every entry,
-- so an unchanged retry sent across the upgrade is still recognised.
CREATE FUNCTION pg_temp.mf_recent_bytes(recent jsonb) RETURNS bytea
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(string_agg(int8send(e.key::bigint) || decode(e.value, 'hex'), ''::bytea
                               ORDER BY e.key::bigint), ''::bytea)
    FROM jsonb_each_text(recent) AS e
$$;
DO $$
BEGIN
    IF (SELECT data_type FROM information_schema.columns WHERE table_schema = current_schema()
        AND table_name = 'agent_stream_positions' AND column_name = 'recent') = 'jsonb' THEN
        ALTER TABLE agent_stream_positions ALTER COLUMN recent TYPE bytea
            USING pg_temp.mf_recent_bytes(recent);
    END IF;
END;
$$;
DROP FUNCTION pg_temp.mf_recent_bytes(jsonb);
