-- Version 5: a projection's folded state (`projection_state.state`) is kept as the bytes of the
-- projection's own JSON instead of jsonb. Nothing but the projection reads it, and PostgreSQL
-- parsing a node's ~10 KB state into jsonb on every append and printing it back on every load
-- costs a third of its CPU per agent report (docs/performance.md). The stored states are
-- converted as they are (jsonb's text is JSON the projection decodes); `rebuild --verify`
-- compares states as JSON values, so a converted checkpoint equals a rebuilt one.
DO $$
BEGIN
    IF (SELECT data_type FROM information_schema.columns
        WHERE table_schema = current_schema() AND table_name = 'projection_state'
          AND column_name = 'state') = 'jsonb' THEN
        ALTER TABLE projection_state ALTER COLUMN state TYPE bytea
            USING convert_to(state::text, 'UTF8');
    END IF;
END;
$$;

DO $$
BEGIN
    ALTER TABLE projection_state ALTER COLUMN state SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN NULL;
END;
$$;

-- mf_open_streams hands out the state as it is stored; a function's result type changes only by
-- dropping it (migrate installs the bytea form after the steps).
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_proc WHERE proname = 'mf_open_streams'
               AND pg_get_function_result(oid) LIKE '%out_state text%') THEN
        DROP FUNCTION mf_open_streams(text[], text);
    END IF;
END;
$$;
