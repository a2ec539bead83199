-- Lifecycle events are permanent: the database itself refuses to change or remove them
-- (trigger events_lifecycle_immutable).
CREATE OR REPLACE FUNCTION mf_refuse_lifecycle_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'lifecycle event % (stream %, version %) is immutable: % refused',
        OLD.global_position, OLD.stream_id, OLD.stream_version, TG_OP
        USING ERRCODE = 'restrict_violation';
END;
$$;
