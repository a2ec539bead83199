-- Whether this PostgreSQL was built with lz4, asked without failing a statement: where it was not
-- (the tests' embedded PostgreSQL is such a build), SET COMPRESSION lz4 raises an error. The new
-- schema asks it before it sets the payload columns' compression (schema.sql).
CREATE OR REPLACE FUNCTION mf_has_lz4() RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_was  text := current_setting('default_toast_compression');
BEGIN
    PERFORM set_config('default_toast_compression', 'lz4', true);
    PERFORM set_config('default_toast_compression', v_was, true);
    RETURN true;
EXCEPTION WHEN invalid_parameter_value OR feature_not_supported THEN
    RETURN false;
END;
$$;
